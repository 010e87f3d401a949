#!/usr/bin/env bash
# The prepared GPU run (see shared/PLATFORM.md): on the lent H200, from the repo root, with the wheels of
# `make gpu-wheels` carried in .gpu_wheels/ (no network there). It is TWO commands (the stages do not fit one 8-minute
# command; `python3 tools/gpu_stages.py plan` shows both): GPU_COMMAND=1 (default) runs the probe, GEMMs, emulation,
# text encoder and trained stages; GPU_COMMAND=2 the headline. The stages and budgets live in tools/gpu_stages.py;
# each stage runs in its own `python3` under its own timeout and appends its rows to the lab's results store the
# moment they end (per shape, length, scheme or pair where a stage has items, packing into $OUT after each item);
# after every stage the rows so far are packed into $OUT, so a stage killed mid-way loses only its unfinished item.
# $OUT ends with three files (at most 8 come back): results.tar.gz (every table, the applied plans, provenance.json,
# status.tsv), run.log, and summary.md (printed last).
#   bash tools/gpu_check.sh                          # command 1 on the GPU machine (the run tool's $OUT)
#   GPU_COMMAND=2 bash tools/gpu_check.sh            # command 2 (the headline), right after, on the warm machine
#   GPU_COMMAND=2 GPU_LIMIT_S=400 bash tools/gpu_check.sh   # ... when the device has less left (its budget_left_s - 20)
#   bash tools/gpu_check.sh --dry-run    # every stage in one command on a CPU at tiny dims (`make gpu-rehearsal`)
#   GPU_STAGES="headline trained" GPU_BUDGET_headline=300 bash tools/gpu_check.sh   # a rerun of some stages, more time
#   GPU_GEMM_EXTRA=1 GPU_STAGES="probe gemm_eager gemm_compiled" bash tools/gpu_check.sh  # GEMMs only, with the small
#     cubes and the weight-only kernels (int8wo, fp8wo, int4wo)
# Bring the rows home with `make gpu-import TARBALL=<the returned results.tar.gz>` (once per command).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=""; [[ "${1:-}" == "--dry-run" ]] && DRY="--dry-run"
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
PY=${GPU_PYTHON:-python3}          # the image's interpreter: a bare `python` may be another one, or none
WORK=${GPU_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/diffq_gpu_run.XXXXXX")}   # outside $OUT: only the packed files land there
DEPS=${GPU_DEPS:-$WORK/deps}
mkdir -p "$WORK/results" "$WORK/cache"
export GPU_DRY=$([[ -n "$DRY" ]] && echo 1 || echo 0) GPU_WORK="$WORK" GPU_OUT="$OUT" DIFFQ_LAB_RESULTS="$WORK/results" \
  DIFFQ_LAB_CACHE="$WORK/cache" HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 \
  PYTHONPATH="$DEPS:$PWD${PYTHONPATH:+:$PYTHONPATH}" \
  TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/diffq_inductor}"
# one run id for the GEMM sweep's rows (both stages, every shape)
export GPU_RUN_ID="${GPU_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)-gpu$(printf '%04x' $RANDOM)}"
LOG="$OUT/run.log"; : > "$LOG"; : > "$WORK/status.tsv"
T_START=$SECONDS
say() { echo "$*" | tee -a "$LOG"; }
budgets=$("$PY" tools/gpu_stages.py budgets $DRY) || { say "cannot read the stage budgets with $PY"; exit 2; }
b() { awk -v n="$1" '$1 == n {print $2}' <<<"$budgets"; }
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$@" >> "$WORK/status.tsv"; }
pack() {
  timeout 20 "$PY" tools/gpu_stages.py pack --work "$WORK" --out "$OUT" >> "$LOG" 2>&1 || say "pack failed (rc $?)"
}
"$PY" tools/gpu_stages.py plan $DRY | tee -a "$LOG"
say "python: $(command -v "$PY") ($("$PY" -V 2>&1)); work folder $WORK; out $OUT; ${DRY:-real run}"

# the carried wheels, beside the image's packages (never over them: --no-deps, on PYTHONPATH only)
t0=$SECONDS
shopt -s nullglob; wheels=(.gpu_wheels/*.whl); shopt -u nullglob
if [[ -n "${GPU_SKIP_INSTALL:-}" ]]; then record install "$(b install)" 0 0 skipped
elif (( ${#wheels[@]} == 0 )); then
  say "no wheels in .gpu_wheels/: run 'make gpu-wheels' and carry .gpu_wheels"
  record install "$(b install)" 0 1 "no wheels"
else
  if "$PY" -m pip --version >/dev/null 2>&1; then
    timeout -k 3 "$(b install)" "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
      --target "$DEPS" "${wheels[@]}" >> "$LOG" 2>&1; rc=$?
  else  # no pip in the image: a wheel is a zip, and --target installs are its files
    say "no pip for $PY: unzipping the wheels into $DEPS"
    timeout -k 3 "$(b install)" "$PY" -c \
      'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
      "$DEPS" "${wheels[@]}" >> "$LOG" 2>&1; rc=$?
  fi
  st=ok; (( rc == 124 || rc == 137 )) && st="killed at its budget"; (( rc != 0 && rc != 124 && rc != 137 )) && st=failed
  record install "$(b install)" $((SECONDS - t0)) "$rc" "$st"
  say "=== install: ${#wheels[@]} wheels, $st (rc $rc, $((SECONDS - t0)) s)"
fi

STAGES=${GPU_STAGES:-$(awk '$1 == "stages" {$1 = ""; print}' <<<"$budgets")}
last=$(echo $STAGES | awk '{print $NF}')
say "command ${GPU_COMMAND:-1}${DRY:+ (dry run: every stage)}: $(echo $STAGES) within $(b limit) s"
for s in $STAGES; do
  bs=$(b "$s"); [[ -z "$bs" ]] && { say "unknown stage $s"; continue; }
  fixed="GPU_BUDGET_$s"
  if [[ "$s" == "$last" && -z "${!fixed:-}" ]]; then  # the last stage gets what the others left of the limit
    left=$(( $(b limit) - (SECONDS - T_START) - 8 ))
    (( left > bs )) && { say "=== $s: $bs s budgeted, $left s left: takes $left"; bs=$left; }
  fi
  fake=(); [[ -n "${GPU_FAKE:-}" ]] && { v="GPU_FAKE_$s"; fake=(--fake "${!v:-$GPU_FAKE}"); }  # tests of this script
  say "=== $s: starts, budget $bs s ($((SECONDS - T_START)) s into the run)"
  t0=$SECONDS
  printf '%s\t%s\n' "$s" "$bs" > "$WORK/running"   # a pack from inside the stage names it as running
  timeout -k 3 "$((bs > 6 ? bs - 3 : bs))" "$PY" tools/gpu_stages.py run "$s" $DRY "${fake[@]}" >> "$LOG" 2>&1; rc=$?
  el=$((SECONDS - t0)); rm -f "$WORK/running"
  st=ok; (( rc == 124 || rc == 137 )) && st="killed at its budget"; (( rc != 0 && rc != 124 && rc != 137 )) && st=failed
  (( rc == 3 )) && st=skipped  # the stage said why it cannot run here (in run.log)
  record "$s" "$bs" "$el" "$rc" "$st"
  say "=== $s: $st (rc $rc, $el s)"
  pack
done
pack
say "run took $((SECONDS - T_START)) s; in $OUT: $(ls "$OUT" | tr '\n' ' ')"
n=$(find "$OUT" -type f | wc -l); (( n > 8 )) && say "WARNING: $n files in $OUT, only 8 come back"
cat "$OUT/summary.md"
awk -F'\t' '$5 != "ok" && $5 != "skipped" {bad = 1} END {exit bad}' "$WORK/status.tsv"
