#!/usr/bin/env bash
# DreamBooth on Ray, Steps 0-6, as one script for a GPU machine or a Ray cluster's head node.
#
#   ./dreambooth_run.sh                       SD 1.4, the example dog photos, one worker per GPU
#   INSTANCE_DIR=~/rex CLASS_NAME=dog ./dreambooth_run.sh     your own photos
#   ./dreambooth_run.sh --tiny                built-in tiny model + images/toy, offline on CPU (1 to 5 minutes on 2 cores)
#   ./dreambooth_run.sh --tiny --arch sdxl    the same with a tiny model of another family (--help lists them)
#   ./dreambooth_run.sh --use_lora            LoRA adapters instead of every weight (combines with the above)
#   ./dreambooth_run.sh --prior_prediction    no class images (Step 3 skipped): the base model's own
#                                             predictions keep the class prior (LoRA or full)
#   ./dreambooth_run.sh --skip_image_setup    train on the photos already in $IMAGES_OWN_DIR
#   ./dreambooth_run.sh --skip_eval           no scores: Step 4 keeps its last step's model, no Step 6
#   ./dreambooth_run.sh -- --use_8bit_adam    everything after -- goes to train.py (as does $TRAIN_ARGS)
#
# Settings are environment variables; `--help` lists each with its default. A preflight checks the
# photos, CLASS_NAME, the GPUs, the free disk and (on a cluster) that DATA_PREFIX is shared before
# Step 1. Every run logs to $LOG_DIR; rerun the same command after a crash and Step 4 continues
# from its newest checkpoint. With RAY_ADDRESS set the steps join that cluster and ship this
# folder's code to its workers; else the script starts a cluster of its own for all its steps and
# stops it at the end (other machines may join it meanwhile: it prints how). Either way with Ray's
# token authentication (RAY_AUTH_MODE=disabled turns it off: docs/CLUSTER.md, "Security").
set -euo pipefail

# name|default (as shown)|meaning. The defaults are applied below, in Step 0.
VARIABLES=(
  "DATA_PREFIX|./data (--tiny: ./data/tiny)|where everything is written (kept across reboots); on a cluster, shared storage (NFS) or a bucket (s3://bucket/prefix: docs/CLUSTER.md, Object storage)"
  "INSTANCE_DIR|the example photos|your 4-6 photos of the subject"
  "SUBJECT|the photos folder's name (example-dog with the example; --tiny: example-toy)|names this subject's outputs: \$DATA_PREFIX/subjects/<SUBJECT>/"
  "CLASS_NAME|dog (--tiny: toy)|what the subject is: dog, backpack, person (needed with INSTANCE_DIR)"
  "UNIQUE_TOKEN|unqtkn|the rare word that names your subject in prompts"
  "SUBJECT_TYPE|live for a live CLASS_NAME (dog, cat, person...), else object|Step 6's prompt set: object or live"
  "ORIG_MODEL_NAME|sd14|base model: a short name (--help lists them, as above) or a hub name (its family is read from its files)"
  "ORIG_MODEL_HASH|the name's pinned commit|commit of the base model to cache"
  "ORIG_MODEL_DIR|\$DATA_PREFIX/model-orig|hub cache folder of the base model"
  "TUNED_MODEL_DIR|\$DATA_PREFIX/subjects/<SUBJECT>/model-tuned|the fine-tuned model (Step 4)"
  "IMAGES_REG_DIR|\$DATA_PREFIX/images-reg/<base model>/<class>[-<resolution>px]|class images (Step 3); one class, base model and size per folder"
  "IMAGES_OWN_DIR|\$DATA_PREFIX/images-own|your photos with --skip_image_setup"
  "IMAGES_EXAMPLE_DIR|\$DATA_PREFIX/images-example|the example photos (never mixed with yours)"
  "IMAGES_NEW_DIR|\$DATA_PREFIX/subjects/<SUBJECT>/images-new|images of the subject from the tuned model (Step 5)"
  "NUM_WORKERS|one per GPU (1 without GPUs)|Ray Train workers"
  "GPUS_PER_WORKER|1|2: UNet on one GPU, text encoder + VAE on a second (24 GB cards)"
  "GPU_MEMORY|each GPU's free memory|GiB: check that training fits cards of this size instead (plan for another card)"
  "NUM_CLASS_IMAGES|200 (--tiny: 20)|class images for the prior-preservation loss"
  "MAX_TRAIN_STEPS|200 (--tiny: 20)|optimizer steps of Step 4, exactly"
  "LEARNING_RATE|train.py's: 5e-6, 1e-4 with --use_lora|AdamW learning rate (passed only when set)"
  "CHECKPOINTING_STEPS|100|a resumable checkpoint every N steps (the newest is kept until the model is saved)"
  "SCORE_STEPS|half of MAX_TRAIN_STEPS|Step 4 scores the model every N steps and at its last, as Step 6 scores (beside the training), and keeps the best-scored step's model (train.py --keep_best); 0: no scores while training, the last step's model"
  "TRAIN_ARGS||more train.py flags, e.g. '--gradient_checkpointing --use_8bit_adam'"
  "HOLDOUT|0|photos kept out of training (the last in name order); Step 6 also scores against them"
  "NUM_INFERENCE_STEPS|50 (--tiny: 10)|denoising steps of every generated image; Step 4's scores too, so a change trains Step 4 again (unless SCORE_STEPS=0)"
  "NUM_NEW_IMAGES|5|Step 5's images (0: Step 5 skipped)"
  "NUM_EVAL_IMAGES|4 (--tiny: 1)|Step 6's images per prompt and model; Step 4's scores too, so a change trains Step 4 again (unless SCORE_STEPS=0)"
  "EVAL_PROMPTS||your own prompt file for the scores of Steps 4 and 6 ('{subject}' in each line); a change trains Step 4 again (unless SCORE_STEPS=0)"
  "EVAL_MODELS_CACHE|\$DATA_PREFIX/model-eval|DINO and CLIP for the scores of Steps 4 and 6"
  "EVAL_DIR|\$DATA_PREFIX/subjects/<SUBJECT>/eval|Step 6's scores, report and images"
  "LOG_DIR|\$DATA_PREFIX/logs (a bucket's: ~/.cache/dreambooth/logs, copied there at the end)|one log file per run"
  "NOTIFY_URL||a Slack/Discord/any webhook told when training starts, ends or fails, and Step 6's scores (never logged)"
  "RETRAIN||1: train Step 4 again even when the model of these settings and photos is there"
  "PYTHON|python|the Python that runs the steps"
)

usage() {
  awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0" | sed 's/^# \{0,1\}//'
  echo
  # The families' own lists (dreambooth/families: each family's folder says its short names and its tiny model)
  "${PYTHON:-python3}" -c 'from dreambooth import families; print(*families.listing(), sep="\n")' 2> /dev/null || echo "(the families' list: python cache_model.py --help, with the Python of requirements.txt)"
  echo
  echo "Variables (set them in the environment first):"
  for entry in "${VARIABLES[@]}"; do
    IFS='|' read -r name default meaning <<<"$entry"
    printf '  %-20s %s (default: %s)\n' "$name" "$meaning" "${default:-none}"
  done
}

COMMAND_LINE="$0"
if [ $# -gt 0 ]; then COMMAND_LINE+="$(printf ' %q' "$@")"; fi
# The command that continues a stopped run: this one with the settings the environment gave it (inline or
# exported), which a rerun needs again; not NOTIFY_URL (never shown) nor RETRAIN (a rerun continues).
RERUN_LINE=
for entry in "${VARIABLES[@]}"; do
  name="${entry%%|*}"
  case "$name" in NOTIFY_URL|RETRAIN) continue ;; esac
  if [ -n "${!name+x}" ]; then RERUN_LINE+="$name=$(printf '%q' "${!name}") "; fi
done
RERUN_LINE+="$COMMAND_LINE"
tiny=false
arch=
skip_image_setup=false
use_lora=false
prior_prediction=false
skip_eval=false
EXTRA_TRAIN_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) tiny=true ;;
    --arch) [ $# -ge 2 ] || { echo "dreambooth_run.sh: error: --arch needs a value: a family's name (--help lists them)" >&2; exit 2; }
      arch="$2"; shift ;;
    --skip_image_setup|--skip-image-setup) skip_image_setup=true ;;  # (each flag in either spelling, as the
    --use_lora|--use-lora) use_lora=true ;;                            # Python scripts take theirs)
    --prior_prediction|--prior-prediction) prior_prediction=true ;;
    --skip_eval|--skip-eval) skip_eval=true ;;
    -h|--help) usage; exit 0 ;;
    --) shift; EXTRA_TRAIN_ARGS=("$@"); break ;;
    *) near="$("$(command -v "${PYTHON:-python}" || command -v python3)" -c 'import difflib, sys  # (a misspelt flag: the nearest)
word = "--" + sys.argv[1].split("=")[0].lstrip("-").replace("-", "_")
print("".join(difflib.get_close_matches(word, sys.argv[2:], 1, 0.75)))' \
        "$1" --tiny --arch --skip_image_setup --use_lora --prior_prediction --skip_eval --help 2> /dev/null)" || near=
      echo "dreambooth_run.sh: error: unknown argument '$1'${near:+; did you mean $near?} (see --help; train.py" \
        "flags go after --)" >&2
      exit 2 ;;
  esac
  shift
done

if [ -n "$arch" ] && ! $tiny; then
  echo "dreambooth_run.sh: error: --arch picks the tiny model's family (with --tiny); a real model's family" \
    "is read from its files (ORIG_MODEL_NAME)" >&2
  exit 2
fi

# Paths given relative to where the script was started stay so after the cd below
for name in DATA_PREFIX INSTANCE_DIR IMAGES_OWN_DIR IMAGES_REG_DIR TUNED_MODEL_DIR IMAGES_NEW_DIR EVAL_DIR \
            EVAL_PROMPTS LOG_DIR ORIG_MODEL_DIR EVAL_MODELS_CACHE; do
  value="${!name:-}"
  case "$value" in ""|/*|s3://*|gs://*) ;; "~"*) printf -v "$name" '%s' "$HOME${value#\~}" ;; *) printf -v "$name" '%s' "$PWD/$value" ;; esac
done
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python}"
# The steps' packages (requirements.txt) in that Python: one line saying so, not each step's traceback
if ! command -v "$PYTHON" > /dev/null; then
  echo "dreambooth_run.sh: error: no '$PYTHON' to run the steps with: . .venv/bin/activate first (the README's" \
    "install), or set PYTHON=/path/to/python" >&2
  exit 1
fi
# (by its full path: the commands printed for later, export's, run in any shell)
PYTHON="$(command -v "$PYTHON")"
if ! missing="$("$PYTHON" -c 'import importlib.util as u; print(" ".join(m for m in ("ray", "torch", "diffusers", "transformers", "PIL") if u.find_spec(m) is None))')" || [ -n "$missing" ]; then
  echo "dreambooth_run.sh: error: $(command -v "$PYTHON") lacks ${missing:-the packages of requirements.txt}:" \
    "run with the Python you installed requirements.txt in (. .venv/bin/activate first, or" \
    "PYTHON=.venv/bin/python ./dreambooth_run.sh)" >&2
  exit 1
fi
if [ -n "$arch" ] && ! "$PYTHON" -c 'import sys; from dreambooth import families
names = ", ".join(families.ARCHS)
sys.exit(sys.argv[1] not in families.ARCHS and f"dreambooth_run.sh: error: --arch {sys.argv[1]}: no tiny model of that "
         f"family; choose from {names}")' "$arch"; then
  exit 2  # (before Ray starts: at once)
fi
CURRENT_STEP=
step() { CURRENT_STEP="${1%%:*}"; echo "=== [$(date '+%Y-%m-%d %H:%M:%S')] Step $1"; }

# Step 0: settings (each variable keeps a value set in the environment)
if $tiny; then
  export HF_HUB_OFFLINE=1
  DATA_PREFIX="${DATA_PREFIX:-$PWD/data/tiny}"
  NUM_CLASS_IMAGES="${NUM_CLASS_IMAGES:-20}"
  MAX_TRAIN_STEPS="${MAX_TRAIN_STEPS:-20}"
  NUM_INFERENCE_STEPS="${NUM_INFERENCE_STEPS:-10}"
  NUM_EVAL_IMAGES="${NUM_EVAL_IMAGES:-1}"
  EXAMPLE_PHOTOS=images/toy EXAMPLE_CLASS=toy
else
  DATA_PREFIX="${DATA_PREFIX:-$PWD/data}"
  NUM_CLASS_IMAGES="${NUM_CLASS_IMAGES:-200}"
  MAX_TRAIN_STEPS="${MAX_TRAIN_STEPS:-200}"
  NUM_INFERENCE_STEPS="${NUM_INFERENCE_STEPS:-50}"
  NUM_EVAL_IMAGES="${NUM_EVAL_IMAGES:-4}"
  EXAMPLE_PHOTOS=images/dog EXAMPLE_CLASS=dog
fi
export DATA_PREFIX
# DATA_PREFIX in a bucket (s3://bucket/prefix: no shared disk needed): the steps read and write it there,
# through this node's copies of its files (XDG_CACHE_HOME/dreambooth); the log is written here and copied there
is_remote() { case "$1" in s3://*|gs://*) return 0 ;; *) return 1 ;; esac; }
REMOTE=false
if is_remote "$DATA_PREFIX"; then REMOTE=true; fi
ORIG_MODEL_NAME="${ORIG_MODEL_NAME:-sd14}"
ORIG_MODEL_HASH="${ORIG_MODEL_HASH:-}"
# the one model cache, as the scripts run by hand find it (modelcache.model_cache_dir)
ORIG_MODEL_DIR="${ORIG_MODEL_DIR:-$DATA_PREFIX/model-orig}"
export ORIG_MODEL_DIR
IMAGES_OWN_DIR="${IMAGES_OWN_DIR:-$DATA_PREFIX/images-own}"
IMAGES_EXAMPLE_DIR="${IMAGES_EXAMPLE_DIR:-$DATA_PREFIX/images-example}"
EVAL_MODELS_CACHE="${EVAL_MODELS_CACHE:-$DATA_PREFIX/model-eval}"
EVAL_PROMPTS="${EVAL_PROMPTS:-}"
if $REMOTE; then
  LOG_DIR="${LOG_DIR:-$("$PYTHON" -c 'from dreambooth import storage; print(storage.cache_home())')/logs}"
else
  LOG_DIR="${LOG_DIR:-$DATA_PREFIX/logs}"
fi
UNIQUE_TOKEN="${UNIQUE_TOKEN:-unqtkn}"
NUM_WORKERS="${NUM_WORKERS:-}"
GPUS_PER_WORKER="${GPUS_PER_WORKER:-1}"
CHECKPOINTING_STEPS="${CHECKPOINTING_STEPS:-100}"
NUM_NEW_IMAGES="${NUM_NEW_IMAGES:-5}"
TRAIN_ARGS="${TRAIN_ARGS:-}"
# TRAIN_ARGS split into words as a shell would, quotes respected ('--validation_prompt "a, b"'), but
# never glob-expanded: a * reaches train.py as a *, not as the names of files here
TRAIN_ARGS_LIST=()
if [ -n "$TRAIN_ARGS" ]; then
  if ! "$PYTHON" -c 'import shlex, sys; shlex.split(sys.argv[1])' "$TRAIN_ARGS" 2> /dev/null; then
    echo "dreambooth_run.sh: error: TRAIN_ARGS has an unclosed quote: $TRAIN_ARGS" >&2
    exit 2
  fi
  mapfile -d '' -t TRAIN_ARGS_LIST < <("$PYTHON" -c 'import shlex, sys; sys.stdout.write("".join(w + "\0" for w in shlex.split(sys.argv[1])))' "$TRAIN_ARGS")
fi
# train.py's flags of yours (TRAIN_ARGS, after --) parsed now, before Ray starts: a typo is one line at once
if [ ${#TRAIN_ARGS_LIST[@]} -gt 0 ] || [ ${#EXTRA_TRAIN_ARGS[@]} -gt 0 ]; then
  "$PYTHON" -c 'import sys; from dreambooth.commands import preflight; preflight.check_train_flags(sys.argv[1:])' \
    "${TRAIN_ARGS_LIST[@]}" "${EXTRA_TRAIN_ARGS[@]}" || exit 2
fi
HOLDOUT="${HOLDOUT:-0}"
# The photos: INSTANCE_DIR if set, $IMAGES_OWN_DIR with --skip_image_setup, else the example's own
# folder (never the one your photos go in: two subjects are never trained as one).
if [ -n "${INSTANCE_DIR:-}" ]; then
  PHOTOS_DIR="$INSTANCE_DIR" PHOTOS_VAR=INSTANCE_DIR example=false
  CLASS_NAME="${CLASS_NAME:-}"
elif $skip_image_setup; then
  PHOTOS_DIR="$IMAGES_OWN_DIR" PHOTOS_VAR=IMAGES_OWN_DIR example=false
  CLASS_NAME="${CLASS_NAME:-}"
else
  PHOTOS_DIR="$IMAGES_EXAMPLE_DIR" PHOTOS_VAR=IMAGES_EXAMPLE_DIR example=true
  CLASS_NAME="${CLASS_NAME:-$EXAMPLE_CLASS}"
fi
slug() { printf '%s' "$1" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g'; }
# Each subject's outputs in a folder of its own: a second subject never replaces the first's
if [ -z "${SUBJECT:-}" ]; then
  if $example; then SUBJECT="example-$EXAMPLE_CLASS"; else SUBJECT="$(slug "$(basename "$PHOTOS_DIR")")"; fi
fi
SUBJECT="$(slug "$SUBJECT")"
SUBJECT="${SUBJECT:-subject}"
TUNED_MODEL_DIR="${TUNED_MODEL_DIR:-$DATA_PREFIX/subjects/$SUBJECT/model-tuned}"
IMAGES_NEW_DIR="${IMAGES_NEW_DIR:-$DATA_PREFIX/subjects/$SUBJECT/images-new}"
EVAL_DIR="${EVAL_DIR:-$DATA_PREFIX/subjects/$SUBJECT/eval}"
# Step 6's prompt set: live for the classes the DreamBooth paper scores as live (pets, people), else object
if [ -z "${SUBJECT_TYPE:-}" ]; then
  SUBJECT_TYPE="$("$PYTHON" -c 'import sys; from dreambooth.evaluation import scoring
print(scoring.subject_type_of(sys.argv[1]))' "$CLASS_NAME")"  # (evaluate.py's own default)
  SUBJECT_TYPE_SAID="$SUBJECT_TYPE (from CLASS_NAME=$CLASS_NAME; set SUBJECT_TYPE to change it)"
else
  SUBJECT_TYPE_SAID="$SUBJECT_TYPE"
fi
# One class folder per base model and class: another CLASS_NAME or ORIG_MODEL_NAME (Flux.1 after SD) never
# finds this one's images (a folder of IMAGES_REG_DIR's drawn by another model stops Step 3 with one line)
CLASS_SLUG="$(slug "$CLASS_NAME")"
if $tiny; then MODEL_SLUG="tiny-${arch:-sd1}"; else MODEL_SLUG="$(slug "$ORIG_MODEL_NAME")"; fi
REG_DIR_DEFAULT=false
if [ -z "${IMAGES_REG_DIR:-}" ]; then
  IMAGES_REG_DIR="$DATA_PREFIX/images-reg/$MODEL_SLUG/${CLASS_SLUG:-class}" REG_DIR_DEFAULT=true
fi
# train.py decides its own defaults (the learning rate from --use_lora, however --use_lora reached it)
LEARNING_RATE="${LEARNING_RATE:-}"
RETRAIN="${RETRAIN:-}"
# A typo in a number stops the run here, in one line, not at the step that reads it (after the download)
SCORE_STEPS="${SCORE_STEPS:-}"
for name in NUM_CLASS_IMAGES MAX_TRAIN_STEPS NUM_INFERENCE_STEPS NUM_NEW_IMAGES NUM_EVAL_IMAGES CHECKPOINTING_STEPS \
            HOLDOUT GPUS_PER_WORKER SCORE_STEPS; do
  if [ "$name" = SCORE_STEPS ] && [ -z "$SCORE_STEPS" ]; then continue; fi  # (unset: decided after the preflight)
  if ! [[ "${!name}" =~ ^[0-9]+$ ]]; then
    echo "dreambooth_run.sh: error: $name=${!name}: must be a whole number (see --help)" >&2
    exit 2
  fi
done
if [ -n "$LEARNING_RATE" ] && ! [[ "$LEARNING_RATE" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]]; then
  echo "dreambooth_run.sh: error: LEARNING_RATE=$LEARNING_RATE: must be a number, e.g. 5e-6 (see --help)" >&2
  exit 2
fi

mkdir -p "$LOG_DIR"
LOG_FILE="$LOG_DIR/dreambooth_run-$(date '+%Y%m%d-%H%M%S').log"
# On a terminal the steps draw progress bars (they see a pipe, so they are told); the log file gets
# each bar's last state as one plain line (no carriage returns, no terminal escapes)
if [ -t 1 ]; then export DREAMBOOTH_TERMINAL=1; fi
# (tee and sed ignore Ctrl-C and SIGTERM: they end when the steps' output does, so that a stopped step's
# last lines, which say where it stopped, still reach the terminal and the log; and a broken pipe: piped into a
# `tee run.log` of the user's, which Ctrl-C ends first, they still reach the log)
exec > >(trap '' INT TERM PIPE; tee >(sed -u -e 's/\x1b\[[0-9;?]*[A-Za-z]//g' -e 's/.*\r\(.\)/\1/' -e 's/\r$//' >> "$LOG_FILE")) 2>&1
printf '%s\nlog of this run: %s\n' "$COMMAND_LINE" "$LOG_FILE"
# Ctrl-C (SIGINT to the whole foreground group: the running step gets it too and stops as it does, train.py
# with a checkpoint of the step it is on) or SIGTERM: once the step has ended, one line says where the run
# stopped and how to go on; exit 130 or 143.
stopped() {
  trap - INT TERM
  echo "dreambooth_run.sh: stopped by $1${CURRENT_STEP:+ in Step $CURRENT_STEP}; the finished steps and" \
    "checkpoints are kept: rerun the same command to continue ($RERUN_LINE)" >&2
  exit "$2"
}
trap 'stopped SIGINT 130' INT
trap 'stopped SIGTERM 143' TERM
# bash runs those traps once the step ends only when the signal found it inside its wait for the step: one that
# lands a moment before or after stays pending, and set -e ends the script first, on the step's status, without
# the line (seen once in a hundred runs). The step's own status says it stopped (130, 143): the same line then.
trap 'case $? in 130) stopped SIGINT 130 ;; 143) stopped SIGTERM 143 ;; esac' ERR


if $example; then  # the example photos, in their own folder (a bucket's: put there from this node's copy)
  EXAMPLE_LOCAL="$PHOTOS_DIR"
  if $REMOTE; then
    EXAMPLE_LOCAL="$("$PYTHON" -c 'import sys; from dreambooth import storage; print(storage.cache_path(sys.argv[1]))' "$PHOTOS_DIR")"
  fi
  mkdir -p "$EXAMPLE_LOCAL"
  if $tiny; then cp -f "$EXAMPLE_PHOTOS"/*.jpg "$EXAMPLE_LOCAL/"; else "$PYTHON" download_example_dataset.py "$EXAMPLE_LOCAL"; fi
  if $REMOTE; then
    "$PYTHON" -c 'import sys; from dreambooth import storage; storage.mirror_up(sys.argv[1], sys.argv[2], None)' \
      "$EXAMPLE_LOCAL" "$PHOTOS_DIR"
  fi
fi

step "0: preflight (photos, CLASS_NAME, GPUs and their memory, disk, shared storage)"
# Step 6's prompt file, read now: a typo found after the training would cost the run its scores
if [ -n "$EVAL_PROMPTS" ] && ! $skip_eval; then
  "$PYTHON" -c 'import sys; from dreambooth import errors; from dreambooth.evaluation import scoring
try:
    scoring.prompt_templates("object", sys.argv[1])
except errors.UserError as err:
    sys.exit(f"dreambooth_run.sh: error: {err}")' "$EVAL_PROMPTS"
fi
PREFLIGHT=(--photos_dir="$PHOTOS_DIR" --photos_var="$PHOTOS_VAR" --class_name="$CLASS_NAME"
  --data_prefix="$DATA_PREFIX" --model_name="$ORIG_MODEL_NAME" --model_cache="$ORIG_MODEL_DIR"
  ${ORIG_MODEL_HASH:+--revision="$ORIG_MODEL_HASH"} --num_workers="$NUM_WORKERS"
  --gpus_per_worker="$GPUS_PER_WORKER" --tuned_model_dir="$TUNED_MODEL_DIR")
$tiny && PREFLIGHT+=(--tiny)
[ -n "$arch" ] && PREFLIGHT+=(--arch="$arch")
[ -n "${GPU_MEMORY:-}" ] && PREFLIGHT+=(--gpu_memory="$GPU_MEMORY")
# the train.py flags that decide its memory: the script's own (as Step 4 passes them), then yours
SCRIPT_TRAIN_ARGS=(--train_batch_size=2)
$use_lora && SCRIPT_TRAIN_ARGS+=(--use_lora)
$prior_prediction && SCRIPT_TRAIN_ARGS+=(--prior_preservation=prior_prediction)
# what needs no Ray first (a missing photo folder, a caption in another encoding: said before a cluster starts)
"$PYTHON" preflight.py "${PREFLIGHT[@]}" --stage=files -- "${SCRIPT_TRAIN_ARGS[@]}" "${TRAIN_ARGS_LIST[@]}" \
  "${EXTRA_TRAIN_ARGS[@]}"

# One Ray cluster for every step (each script would otherwise start and stop its own, seconds each):
# the cluster RAY_ADDRESS names is joined and left running; else one starts here and stops when this
# script ends, however it ends. Never the cluster Ray's temp folder names (a `ray start` of someone
# else's): a step joins only the address handed to it.
RAY_HEAD_PID= RAY_HEAD_TEMP=
# Ray's token authentication for the head started here and every step (raycluster.ensure_ray_token: the
# token of RAY_AUTH_TOKEN or its file is reused, else one is made that only you can read)
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
RAY_AUTH="$("$PYTHON" -c 'from dreambooth.cluster import raycluster; raycluster.ensure_ray_token(); print(raycluster.ray_auth_note())')"
EVAL_FETCH_PID=
drop_fetch_files() {  # the background fetch's path file, and its log when the fetch had nothing to say
  rm -f "$EVAL_FETCH_LOG.path"
  if [ ! -s "$EVAL_FETCH_LOG" ]; then rm -f "$EVAL_FETCH_LOG"; fi
}
stop_ray() {  # at exit, however the script ends: the background fetch too (Step 1), and its files when it said nothing
  local status=$?
  if [ -n "$EVAL_FETCH_PID" ]; then
    kill -TERM "$EVAL_FETCH_PID" 2>/dev/null || true
    wait "$EVAL_FETCH_PID" 2>/dev/null || true
    drop_fetch_files
  fi
  if [ -n "$RAY_HEAD_PID" ]; then
    kill -TERM "$RAY_HEAD_PID" 2>/dev/null || true
    wait "$RAY_HEAD_PID" 2>/dev/null || true
  fi
  if [ -n "$RAY_HEAD_TEMP" ]; then
    # (a run that ended well, or was stopped, ends its log with its outputs or where it stopped; one that failed,
    # with the head's log)
    if [[ ! "$status" =~ ^(0|130|143)$ ]] && [ -s "$RAY_HEAD_TEMP/head.log" ]; then
      { echo "--- the Ray head's own log ($RAY_ADDRESS) ---"; cat "$RAY_HEAD_TEMP/head.log"; } >> "$LOG_FILE"
    fi
    rm -rf "$RAY_HEAD_TEMP"
  fi
  if $REMOTE; then  # the log beside the run's outputs in the bucket
    "$PYTHON" -c 'import sys; from dreambooth import storage; storage.upload_file(*sys.argv[1:])' \
      "$LOG_FILE" "$DATA_PREFIX/logs/$(basename "$LOG_FILE")" || echo "dreambooth_run.sh: the log stays in $LOG_FILE" >&2
  fi
}
trap stop_ray EXIT
if [ -n "${RAY_ADDRESS:-}" ]; then
  echo "Ray: joining the cluster at RAY_ADDRESS=$RAY_ADDRESS; $RAY_AUTH"
else
  # Its own temp folder in Ray's (RAY_TMPDIR, else /tmp; short: Ray's socket paths must fit 108 characters),
  # so that its address is not written where every later `ray.init()` on this node would find and join it.
  RAY_HEAD_TEMP="$(mktemp -d "${RAY_TMPDIR:-/tmp}/dreambooth-ray-XXXXXX")"
  RAY_HEAD_LOG="$RAY_HEAD_TEMP/head.log"  # (appended to this run's log when it fails: one log a run)
  : > "$RAY_HEAD_LOG"  # (there before the wait below reads it: the background start creates it a moment later)
  # A free port, not Ray's 6379: a cluster already running here (another run, a `ray start` of
  # yours) is left alone and never joined
  # (never one of the ports a Ray node takes by default whatever --port says: raycluster.free_port).
  # Ray's metrics servers (with ray[default] installed) answer anyone over HTTP: off here, as
  # raycluster.CLOSED_METRICS turns them off for the scripts' own clusters (docs/CLUSTER.md, "Security").
  # The options of every head of ours: raycluster.head_start_options. (One Python start for the three.)
  HEAD_SETUP="$("$PYTHON" -c 'import shlex; from dreambooth.cluster import raycluster
print(f"RAY_HEAD_PORT={raycluster.free_port()}")
print(raycluster.closed_metrics_exports())
print("RAY_HEAD_OPTIONS=(" + " ".join(map(shlex.quote, raycluster.head_start_options())) + ")")')"
  eval "$HEAD_SETUP"
  # (no drain at the end: nothing runs by then, and Ray would wait 30 s for idle workers)
  RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 "$PYTHON" -m ray.scripts.scripts start --head --block \
    --port="$RAY_HEAD_PORT" "${RAY_HEAD_OPTIONS[@]}" --temp-dir="$RAY_HEAD_TEMP" > "$RAY_HEAD_LOG" 2>&1 &
  RAY_HEAD_PID=$!
  while kill -0 "$RAY_HEAD_PID" 2>/dev/null && ! grep -q "block forever" "$RAY_HEAD_LOG"; do sleep 0.2; done
  if ! kill -0 "$RAY_HEAD_PID" 2>/dev/null; then
    RAY_HEAD_PID=
    echo "dreambooth_run.sh: error: Ray did not start ($(grep -m 1 -i "error" "$RAY_HEAD_LOG" || tail -n 1 "$RAY_HEAD_LOG"));" \
      "its log is at the end of this run's: $LOG_FILE" >&2
    exit 1
  fi
  RAY_ADDRESS="$(grep -o "ray start --address='[^']*'" "$RAY_HEAD_LOG" | head -n 1 | cut -d"'" -f2)"
  export RAY_ADDRESS
  echo "Ray: started a cluster for this run at $RAY_ADDRESS (stopped at exit; its own log goes at the end of this" \
    "run's if the run fails); $RAY_AUTH"
  echo "  more machines may join it while it runs: RAY_AUTH_MODE=token" \
    "RAY_enable_metrics_collection=$RAY_enable_metrics_collection ray start --address=$RAY_ADDRESS" \
    "(with the same token in their ~/.ray/auth_token or RAY_AUTH_TOKEN)"
fi

# (each step joins this cluster: the line above says so once, not a "Ray: joined" line per step)
export DREAMBOOTH_RAY_SAID="$RAY_ADDRESS"

PREFLIGHT_OUT="$("$PYTHON" preflight.py "${PREFLIGHT[@]}" --stage=cluster -- "${SCRIPT_TRAIN_ARGS[@]}" \
  "${TRAIN_ARGS_LIST[@]}" "${EXTRA_TRAIN_ARGS[@]}")"
resolved() { printf '%s\n' "$PREFLIGHT_OUT" | sed -n "s/^$1=//p" | tail -n 1; }
NUM_WORKERS="$(resolved NUM_WORKERS)"
# train.py's flags given after -- or in TRAIN_ARGS win over the script's: the steps use their values
TRAIN_STEPS="$(resolved MAX_TRAIN_STEPS)"; TRAIN_STEPS="${TRAIN_STEPS:-$MAX_TRAIN_STEPS}"
TRAIN_RESOLUTION="$(resolved RESOLUTION)"
# class images are drawn at the training resolution: another resolution, another default folder
if $REG_DIR_DEFAULT && [ -n "$TRAIN_RESOLUTION" ]; then IMAGES_REG_DIR="$IMAGES_REG_DIR-${TRAIN_RESOLUTION}px"; fi
# Scores while training, the best step's model kept: at half the steps and at the last unless SCORE_STEPS says
# otherwise; none with --skip_eval (no scoring models then)
if $skip_eval; then
  SCORE_STEPS=0
elif [ -z "$SCORE_STEPS" ]; then
  SCORE_STEPS=$(( (TRAIN_STEPS + 1) / 2 ))
fi

# The resolved settings, once
for entry in "${VARIABLES[@]}"; do
  name="${entry%%|*}"
  case "$name" in INSTANCE_DIR) value="$PHOTOS_DIR" ;; SUBJECT_TYPE) value="$SUBJECT_TYPE_SAID" ;;
    ORIG_MODEL_NAME) if $tiny; then value="(--tiny: the built-in tiny ${arch:-sd1} model)"; else value="$ORIG_MODEL_NAME"; fi ;;
    MAX_TRAIN_STEPS) value="$TRAIN_STEPS" ;; LEARNING_RATE) value="${LEARNING_RATE:-train.py default}" ;;
    NOTIFY_URL) value="${NOTIFY_URL:+(set; a webhook URL is not shown)}" ;;
    ORIG_MODEL_HASH|GPU_MEMORY) if $tiny; then value="(not used with --tiny)"; else value="${!name:-}"; fi ;;
    *) value="${!name:-}" ;; esac
  if [ -z "$value" ]; then  # (unset: what that means, as --help says it)
    IFS='|' read -r _ default _ <<<"$entry"
    value="(${default:-none})"
  fi
  printf '  %-20s %s\n' "$name" "$value"
done
# (a webhook URL is a secret: not shown)
EXTRA_SHOWN="$TRAIN_ARGS${TRAIN_ARGS:+${EXTRA_TRAIN_ARGS[*]:+ }}${EXTRA_TRAIN_ARGS[*]:-}"
echo "  train.py extra flags: ${EXTRA_SHOWN:-(none)}" | sed -E 's#(--notify_url[= ])[^ ]+#\1(not shown)#g'
is_remote "$ORIG_MODEL_DIR" || mkdir -p "$ORIG_MODEL_DIR"  # (the subject's folders come with its first output)

step "1: cache the base model ($($tiny && echo "the built-in tiny one" || echo "$ORIG_MODEL_NAME"))"
if $tiny; then
  ORIG_MODEL_PATH="$("$PYTHON" cache_model.py --model_dir="$ORIG_MODEL_DIR" --tiny ${arch:+--arch="$arch"} \
    | tail -n 1)"
else
  ORIG_MODEL_PATH="$("$PYTHON" cache_model.py --model_dir="$ORIG_MODEL_DIR" --model_name="$ORIG_MODEL_NAME" \
    ${ORIG_MODEL_HASH:+--revision="$ORIG_MODEL_HASH"} | tail -n 1)"
fi
export ORIG_MODEL_PATH
echo "base model: $ORIG_MODEL_PATH"

# The scoring models (DINO, CLIP) of Step 4's scores and Step 6 are fetched meanwhile, in the background: their
# download (or, with --tiny, their building) overlaps Steps 1-3
if ! $skip_eval; then
  if $tiny; then EVAL_FLAGS=(--tiny); else EVAL_FLAGS=(); fi
  EVAL_FETCH_LOG="$LOG_DIR/eval-models-$(date '+%Y%m%d-%H%M%S').log"
  "$PYTHON" cache_model.py --model_dir="$EVAL_MODELS_CACHE" --eval_models "${EVAL_FLAGS[@]}" \
    > "$EVAL_FETCH_LOG.path" 2> "$EVAL_FETCH_LOG" < /dev/null &
  EVAL_FETCH_PID=$!
  if $tiny; then
    echo "the scoring models (tiny DINO and CLIP): built in the background (a failure names its log)"
  else  # (in the cache already: nothing is downloaded)
    echo "the scoring models (DINO, CLIP): from $EVAL_MODELS_CACHE, fetched there first if missing, in the" \
      "background (a failure names its log)"
  fi
fi

# The background fetch's scoring models, once it has ended (EVAL_MODELS_DIR); if it failed, its log's end and one
# line, $1 saying what stays
EVAL_MODELS_DIR=
scoring_models() {
  if [ -n "$EVAL_MODELS_DIR" ]; then return; fi
  if ! wait "$EVAL_FETCH_PID"; then
    EVAL_FETCH_PID=
    rm -f "$EVAL_FETCH_LOG.path"
    tail -n 20 "$EVAL_FETCH_LOG"
    echo "dreambooth_run.sh: error: getting the scoring models (DINO, CLIP) failed (log: $EVAL_FETCH_LOG); $1" >&2
    exit 1
  fi
  EVAL_FETCH_PID=
  EVAL_MODELS_DIR="$(tail -n 1 "$EVAL_FETCH_LOG.path")"
  drop_fetch_files  # (no empty file per run)
}

step "2: photos of the subject: $PHOTOS_DIR"

if $prior_prediction; then
  step "3: skipped (--prior_prediction: the base model's own predictions for 'photo of a $CLASS_NAME' keep the prior)"
  CLASS_OPTIONS=(--prior_preservation=prior_prediction)
else
  step "3: class images of 'photo of a $CLASS_NAME' in $IMAGES_REG_DIR (a rerun only tops up)"
  is_remote "$IMAGES_REG_DIR" || mkdir -p "$IMAGES_REG_DIR"
  "$PYTHON" generate.py \
    --model_dir="$ORIG_MODEL_PATH" \
    --output_dir="$IMAGES_REG_DIR" \
    --prompts="photo of a $CLASS_NAME" \
    --num_samples_per_prompt="$NUM_CLASS_IMAGES" \
    --num_inference_steps="$NUM_INFERENCE_STEPS" \
    ${TRAIN_RESOLUTION:+--resolution="$TRAIN_RESOLUTION"} \
    --class_images \
    --use_ray_data
  CLASS_OPTIONS=(--class_images_dir="$IMAGES_REG_DIR" --num_class_images="$NUM_CLASS_IMAGES")
fi

SCORE_OPTIONS=()
if [ "$SCORE_STEPS" -gt 0 ]; then  # (the scoring models are needed from the run's start: the run checks them first)
  scoring_models "nothing was trained yet: rerun, or SCORE_STEPS=0 to train without scores"
  SCORE_OPTIONS=(--score_steps="$SCORE_STEPS" --keep_best --eval_models_dir="$EVAL_MODELS_DIR"
    --class_name="$CLASS_NAME" --unique_token="$UNIQUE_TOKEN" --subject_type="$SUBJECT_TYPE"
    ${EVAL_PROMPTS:+--eval_prompts="$EVAL_PROMPTS"} --eval_images_per_prompt="$NUM_EVAL_IMAGES"
    --validation_inference_steps="$NUM_INFERENCE_STEPS")
  SCORED=", scored every $SCORE_STEPS steps and at the last, the best step's model kept"
else
  SCORED=", the last step's model kept"
fi
step "4: fine-tune on $NUM_WORKERS worker(s), $TRAIN_STEPS steps$SCORED (a rerun continues a stopped run and keeps a finished one)"
# (with --use_lora: LoRA adapters on the UNet and the text encoder, at LoRA's usual learning rate)
if $use_lora; then
  TRAIN_OPTIONS=(--use_lora)
  GENERATE_OPTIONS=(--model_dir="$ORIG_MODEL_PATH" --lora_weights_dir="$TUNED_MODEL_DIR")
else
  TRAIN_OPTIONS=()
  GENERATE_OPTIONS=(--model_dir="$TUNED_MODEL_DIR")
fi
"$PYTHON" train.py \
  --model_dir="$ORIG_MODEL_PATH" \
  --output_dir="$TUNED_MODEL_DIR" \
  --instance_images_dir="$PHOTOS_DIR" \
  --instance_prompt="photo of $UNIQUE_TOKEN $CLASS_NAME" \
  "${CLASS_OPTIONS[@]}" \
  --class_prompt="photo of a $CLASS_NAME" \
  --train_batch_size=2 \
  ${LEARNING_RATE:+--lr="$LEARNING_RATE"} \
  --max_train_steps="$MAX_TRAIN_STEPS" \
  --num_workers="$NUM_WORKERS" \
  --gpus_per_worker="$GPUS_PER_WORKER" \
  --checkpointing_steps="$CHECKPOINTING_STEPS" \
  $([ -n "$RETRAIN" ] || echo --resume_from_checkpoint=auto) \
  --holdout="$HOLDOUT" \
  ${NOTIFY_URL:+--notify_url="$NOTIFY_URL"} \
  "${SCORE_OPTIONS[@]}" "${TRAIN_OPTIONS[@]}" "${TRAIN_ARGS_LIST[@]}" "${EXTRA_TRAIN_ARGS[@]}"
# the scores and the export of a model this run replaced (another mode or base model for this subject) never stay
# beside it
EXPORT_FILE="$DATA_PREFIX/subjects/$SUBJECT/$SUBJECT.safetensors"
"$PYTHON" -c 'import sys; from dreambooth.evaluation import eval_report; from dreambooth.commands import export
eval_report.forget_stale_scores(*sys.argv[1:4]); export.forget_stale_file(sys.argv[4], sys.argv[2])' \
  "$EVAL_DIR" "$TUNED_MODEL_DIR" "$($skip_eval && echo 0 || echo 1)" "$EXPORT_FILE"

if [ "$NUM_NEW_IMAGES" = 0 ]; then
  step "5: skipped (NUM_NEW_IMAGES=0)"
  "$PYTHON" -c 'import sys; from dreambooth.evaluation import eval_report; eval_report.forget_stale_images(*sys.argv[1:])' \
    "$IMAGES_NEW_DIR" "$TUNED_MODEL_DIR"
else
  step "5: $NUM_NEW_IMAGES images of the subject in $IMAGES_NEW_DIR"
  "$PYTHON" generate.py \
    "${GENERATE_OPTIONS[@]}" \
    --output_dir="$IMAGES_NEW_DIR" \
    --prompts="photo of a $UNIQUE_TOKEN $CLASS_NAME in a bucket" \
    --num_samples_per_prompt="$NUM_NEW_IMAGES" \
    --num_inference_steps="$NUM_INFERENCE_STEPS" \
    --force  # images of an earlier model (a retrained one) are drawn again, never kept beside these
fi

outputs() {  # the last lines: every output of this subject, and how to take the model elsewhere
  echo "outputs of subject '$SUBJECT':"
  echo "  model:  $TUNED_MODEL_DIR"
  if [ "$NUM_NEW_IMAGES" != 0 ]; then echo "  images: $IMAGES_NEW_DIR (contact sheet: $IMAGES_NEW_DIR/grid/grid.png)"; fi
  if ! $skip_eval; then echo "  scores: $EVAL_DIR/report.md"; fi
  if $REMOTE; then  # (copied beside the outputs when the script ends)
    echo "  log:    $DATA_PREFIX/logs/$(basename "$LOG_FILE") (this node's copy: $LOG_FILE)"
  else
    echo "  log:    $LOG_FILE"
  fi
  # (a command only for what export.py writes of the family and the adapters: the hint is a command that works;
  # else why there is none)
  # (neither when the model could not be read)
  local no_file
  if no_file="$("$PYTHON" -c 'import sys; from dreambooth.commands import export
print(export.why_no_file(sys.argv[2], sys.argv[1]) or "")' "$ORIG_MODEL_PATH" "$TUNED_MODEL_DIR" 2> /dev/null)"; then
    if [ -z "$no_file" ]; then
      local command
      command="$PYTHON export.py --model_dir $(printf '%q' "$TUNED_MODEL_DIR")"
      command+=" --output_file $(printf '%q' "$EXPORT_FILE")"
      if [ -f "$EXPORT_FILE" ]; then  # (of this model: one of the model this run replaced is gone)
        echo "  for AUTOMATIC1111/ComfyUI: $EXPORT_FILE (exported; to write it again: $command --overwrite)"
      else
        echo "  for AUTOMATIC1111/ComfyUI: $command"
      fi
    else
      echo "  for AUTOMATIC1111/ComfyUI: no single file: $no_file"
    fi
  fi
}
if $skip_eval; then
  step "6: skipped (--skip_eval)"
  outputs
  exit 0
fi

step "6: scores of the tuned model beside the base model (DINO, CLIP-I, CLIP-T, DIV, PRES)"
if [ "$NUM_NEW_IMAGES" = 0 ]; then made="the tuned model is in $TUNED_MODEL_DIR"
else made="the tuned model and its images are in $TUNED_MODEL_DIR and $IMAGES_NEW_DIR"; fi
scoring_models "$made"
# (at the training's resolution, as Step 4 scored its steps: the kept step's images and scores are those Step 4 made)
"$PYTHON" evaluate.py \
  --model_dir="$TUNED_MODEL_DIR" \
  --instance_data_dir="$PHOTOS_DIR" \
  --unique_token="$UNIQUE_TOKEN" \
  --class_name="$CLASS_NAME" \
  --subject_type="$SUBJECT_TYPE" \
  ${EVAL_PROMPTS:+--eval_prompts="$EVAL_PROMPTS"} \
  --eval_models_dir="$EVAL_MODELS_DIR" \
  --output_dir="$EVAL_DIR" \
  --num_samples_per_prompt="$NUM_EVAL_IMAGES" \
  --holdout="$HOLDOUT" \
  ${NOTIFY_URL:+--notify_url="$NOTIFY_URL"} \
  ${TRAIN_RESOLUTION:+--resolution="$TRAIN_RESOLUTION"} \
  --num_inference_steps="$NUM_INFERENCE_STEPS"

echo "done: scores of the tuned model beside the base model in $EVAL_DIR/report.md"
outputs
