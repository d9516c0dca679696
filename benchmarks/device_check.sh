#!/usr/bin/env bash
# One prepared check of specjax on whatever accelerator is present (or the CPU), <= 8 min
# by default, gathered into one JSON. Phases (DEVICE_CHECK_PHASES picks them; default
# "scale alpha_k_scale breakeven_scale", the ones only an accelerator can run):
#   scale            an 8B-class Llama shape (DEVICE_CHECK_TARGET, default llama3-8b; random
#                    bf16 weights): plain decoding at batch 1 and 8 against the
#                    measured-bandwidth roofline, verification cost for 1-64 rows, the bare
#                    matmul chain, speculation against its prediction (bench_core.py);
#   alpha_k_scale    the controlled-α drafter on that shape (α 0.6 / 0.8 / 0.9, k 2 / 4 / 8,
#                    T = 0), the draft's cost paid by a random DEVICE_CHECK_DRAFT model
#                    (default llama3-draft): measured speedup ÷ the calibrated prediction;
#   breakeven_scale  the same at α 0.8, k = 4 over batch 1 / 8 / 64: measured vs calibrated
#                    speedup by batch, so the break-even batch of both (a random draft
#                    model would accept nothing, so batch_breakeven's own pair cannot serve);
#   eagle_scale      α 0.6 / 0.8 / 0.9 at k = 4 with the cost of a random EAGLE-shaped head
#                    on the target (draft "eagle") instead of the draft model's;
#   tree_scale       α 0.6 / 0.8 / 0.9 with the draft model's cost on the tree (2, 2, 1, 1):
#                    tree vs alpha_k_scale's chain of 4 at equal α;
#   scale_flags      plain decoding of the scale shape at batch 1 under
#                    DEVICE_CHECK_XLA_FLAGS (default: XLA's Triton GEMM fusions off, so
#                    one-row products go to cuBLAS): the first H200 run read 46.5% of the
#                    bandwidth floor, and one-row GEMMs are a suspect;
#   quickstart, batch_breakeven, bench_core   the embedded pair and GPT-2-small shapes
#                    (opt-in; measured on an H200 before: BUILD_NOTES.md).
# The six scale phases run on a GPU only (skipped and recorded on a CPU, unless
# DEVICE_CHECK_FORCE=1: the tests run them on a tiny shape). The study phases' random
# target keeps the shape's vocabulary (DEVICE_CHECK_VOCAB, default 128,256: its LM head is
# ~6% of an 8B model's weights) behind byte prompts ("random:NAME:vocab_size=N"). Phase limits follow the first runs on an H200 (BUILD_NOTES.md):
# quickstart 152 s with the pair's training (38 s there), a batch_breakeven point ~72 s
# (compiles and calibration dominate), bench_core > 170 s for fp32 + bf16.
# DEVICE_CHECK_LIMIT_SCALE=N (a whole number, default 1) multiplies every phase limit: the
# tests force the GPU phases on a 2-core CPU, where compiles alone can pass a GPU's limit.
#
#   bash benchmarks/device_check.sh [OUT_DIR]        (default: device_check/)
#
# Run it from the repository root. Nothing is downloaded: gin-config, when not installed,
# is taken from a wheel in .whl/ (pip download gin-config into .whl/ beforehand). Each phase
# has its own time limit; a phase that fails or runs out of time is recorded as such in the
# JSON and the next one still runs. The models and calibrations are cached under
# OUT_DIR/cache (SPECJAX_CACHE_DIR), so a second run skips the training.
set -uo pipefail

OUT_DIR=${1:-device_check}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
export SPECJAX_CACHE_DIR=${SPECJAX_CACHE_DIR:-$OUT_DIR/cache}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

if ! "$PY" -c "import gin" 2>/dev/null; then
  if ls .whl/gin_config*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/specjax_site \
      .whl/gin_config*.whl || exit 2
    export PYTHONPATH=/tmp/specjax_site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "device_check: gin-config is not installed and no .whl/gin_config*.whl is here" >&2
    exit 2
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

LIMIT_SCALE=${DEVICE_CHECK_LIMIT_SCALE:-1}
if ! [[ "$LIMIT_SCALE" =~ ^[1-9][0-9]*$ ]]; then
  echo "device_check: DEVICE_CHECK_LIMIT_SCALE=$LIMIT_SCALE is not a whole number >= 1" >&2
  exit 2
fi
phase() {  # phase NAME SECONDS COMMAND...: runs it, logs to OUT_DIR/NAME.log, records rc
  local name=$1 limit=$(($2 * LIMIT_SCALE)); shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "{\"phase\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start))}" \
    >>"$OUT_DIR/phases.jsonl"
  tail -n 5 "$OUT_DIR/$name.log"
}

PHASES=${DEVICE_CHECK_PHASES:-scale alpha_k_scale breakeven_scale eagle_scale tree_scale scale_flags}
TARGET=${DEVICE_CHECK_TARGET:-llama3-8b}
STUDY_TARGET="random:$TARGET:vocab_size=${DEVICE_CHECK_VOCAB:-128256}"
DRAFT=${DEVICE_CHECK_DRAFT:-llama3-draft}
wanted() { [[ " $PHASES " == *" $1 "* ]]; }
rm -f "$OUT_DIR/phases.jsonl"
"$PY" - >"$OUT_DIR/environment.json" <<'PYEOF'
import json, platform, jax
print(json.dumps({"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
                  "jax": jax.__version__, "python": platform.python_version()}))
PYEOF

BACKEND=$("$PY" -c "import jax; print(jax.default_backend())" 2>/dev/null)
scale_phase() {  # scale_phase NAME: true when NAME is wanted and can run here
  wanted "$1" || return 1
  [ "$BACKEND" = gpu ] || [ "${DEVICE_CHECK_FORCE:-0}" = 1 ] && return 0
  echo "{\"phase\": \"$1\", \"skipped\": \"backend $BACKEND is not a GPU\"}" \
    >>"$OUT_DIR/phases.jsonl"
  return 1
}
scale_phase scale && phase scale 170 "$PY" benchmarks/bench_core.py --target "$TARGET" \
  --draft "$DRAFT" --dtype bfloat16 --batch 1 8 --ts 1 4 8 16 32 64 --k 3 --repeats 3 \
  --new-tokens 64 --context "${DEVICE_CHECK_CONTEXT:-512}" \
  --cache-len "${DEVICE_CHECK_CACHE_LEN:-1024}" --bandwidth-from copy \
  --out "$OUT_DIR/scale.json"
scale_phase alpha_k_scale && phase alpha_k_scale 100 "$PY" -m specjax.cli run alpha_k_sweep \
  --no-progress --out "$OUT_DIR/alpha_k_scale" --set "target=$STUDY_TARGET" \
  --set "draft=$DRAFT" --set temperature=0.0 --axis alpha=0.6,0.8,0.9 --axis k=4,2,8 \
  --set max_new_tokens=64 --set prompt_len=64 --set repeats=2 --set mc_cycles=2000
scale_phase breakeven_scale && phase breakeven_scale 60 "$PY" -m specjax.cli run \
  alpha_k_sweep --no-progress --out "$OUT_DIR/breakeven_scale" --set "target=$STUDY_TARGET" \
  --set "draft=$DRAFT" --set temperature=0.0 --set alpha=0.8 --set k=4 --axis batch=1,8,64 \
  --set max_new_tokens=32 --set prompt_len=64 --set repeats=2 --set mc_cycles=2000
scale_phase eagle_scale && phase eagle_scale 50 "$PY" -m specjax.cli run alpha_k_sweep \
  --no-progress --out "$OUT_DIR/eagle_scale" --set "target=$STUDY_TARGET" --set draft=eagle \
  --set temperature=0.0 --axis alpha=0.6,0.8,0.9 --set k=4 --set max_new_tokens=64 \
  --set prompt_len=64 --set repeats=2 --set mc_cycles=2000
scale_phase tree_scale && phase tree_scale 50 "$PY" -m specjax.cli run alpha_k_sweep \
  --no-progress --out "$OUT_DIR/tree_scale" --set "target=$STUDY_TARGET" --set "draft=$DRAFT" \
  --set temperature=0.0 --axis alpha=0.6,0.8,0.9 --set k=4 --set "tree=(2, 2, 1, 1)" \
  --set max_new_tokens=64 --set prompt_len=64 --set repeats=2 --set mc_cycles=2000
scale_phase scale_flags && XLA_FLAGS="${XLA_FLAGS:-} ${DEVICE_CHECK_XLA_FLAGS:-\
--xla_gpu_enable_triton_gemm=false}" phase scale_flags 50 "$PY" benchmarks/bench_core.py \
  --target "$TARGET" --draft "$DRAFT" --dtype bfloat16 --batch 1 --repeats 3 \
  --new-tokens 64 --context "${DEVICE_CHECK_CONTEXT:-512}" \
  --cache-len "${DEVICE_CHECK_CACHE_LEN:-1024}" --bandwidth-from copy --plain-only \
  --out "$OUT_DIR/scale_flags.json"
wanted quickstart && phase quickstart 200 "$PY" -m specjax.cli run configs/quickstart.gin --no-progress \
  --out "$OUT_DIR/quickstart"
wanted batch_breakeven && phase batch_breakeven 170 "$PY" -m specjax.cli run configs/batch_breakeven.gin --no-progress \
  --out "$OUT_DIR/batch_breakeven" \
  --gin_param 'sweeps.Sweep.axes = {"batch": [1, 64], "k": [4]}' \
  --gin_param 'sweeps.Sweep.fixed = {"max_new_tokens": 32, "prompt_len": 64, "temperature": 0.0, "repeats": 3, "models": "default", "draft_cost": "full", "calibration_k": (4,), "calibration_repeats": 3}'
wanted bench_core && phase bench_core 110 "$PY" benchmarks/bench_core.py --dtype float32 --repeats 3 --new-tokens 32 \
  --out "$OUT_DIR/bench_core.json"

"$PY" - "$OUT_DIR" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def rows(name):
  f = out / name / "results.jsonl"
  return [json.loads(l) for l in f.read_text().splitlines() if l.strip()] if f.exists() else None
bench, scale, flags = out / "bench_core.json", out / "scale.json", out / "scale_flags.json"
summary = {
    "environment": json.loads((out / "environment.json").read_text()),
    "phases": [json.loads(l) for l in (out / "phases.jsonl").read_text().splitlines()],
    "quickstart": rows("quickstart"),
    "batch_breakeven": rows("batch_breakeven"),
    "alpha_k_scale": rows("alpha_k_scale"),
    "breakeven_scale": rows("breakeven_scale"),
    "eagle_scale": rows("eagle_scale"),
    "tree_scale": rows("tree_scale"),
    "bench_core": json.loads(bench.read_text()) if bench.exists() else None,
    "scale": json.loads(scale.read_text()) if scale.exists() else None,
    "scale_flags": json.loads(flags.read_text()) if flags.exists() else None,
}
(out / "device_check.json").write_text(json.dumps(summary, indent=1))
print(f"device_check: wrote {out / 'device_check.json'}")
PYEOF
