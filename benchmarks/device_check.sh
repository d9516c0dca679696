#!/usr/bin/env bash
# One prepared check of specjax on whatever accelerator is present (or the CPU), <= 8 min:
# the scale check (an 8B-class Llama shape, random bf16 weights: plain decoding at batch 1 and
# 8 against the measured-bandwidth roofline, verification cost for 1-64 rows, speculation
# against its prediction; GPU only, skipped on a CPU), the quickstart (the embedded pair), a
# reduced batch_breakeven and bench_core (GPT-2-small shapes, fp32), gathered into one JSON.
# DEVICE_CHECK_PHASES picks phases (default: all, "scale quickstart batch_breakeven
# bench_core"). Phase limits follow the first
# run on an H200 (BUILD_NOTES.md): quickstart 152 s with the pair's training (38 s there), a
# batch_breakeven point ~72 s (compiles and calibration dominate), bench_core > 170 s for
# fp32 + bf16.
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

phase() {  # phase NAME SECONDS COMMAND...: runs it, logs to OUT_DIR/NAME.log, records rc
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "{\"phase\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start))}" \
    >>"$OUT_DIR/phases.jsonl"
  tail -n 5 "$OUT_DIR/$name.log"
}

PHASES=${DEVICE_CHECK_PHASES:-scale quickstart batch_breakeven bench_core}
wanted() { [[ " $PHASES " == *" $1 "* ]]; }
rm -f "$OUT_DIR/phases.jsonl"
"$PY" - >"$OUT_DIR/environment.json" <<'PYEOF'
import json, platform, jax
print(json.dumps({"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
                  "jax": jax.__version__, "python": platform.python_version()}))
PYEOF

BACKEND=$("$PY" -c "import jax; print(jax.default_backend())" 2>/dev/null)
if wanted scale && [ "$BACKEND" = gpu ]; then
  phase scale 230 "$PY" benchmarks/bench_core.py --target llama3-8b --draft llama3-draft \
    --dtype bfloat16 --batch 1 8 --ts 1 4 8 16 32 64 --k 3 --repeats 3 --new-tokens 64 \
    --context 512 --cache-len 1024 --bandwidth-from copy --out "$OUT_DIR/scale.json"
elif wanted scale; then
  echo "{\"phase\": \"scale\", \"skipped\": \"backend $BACKEND is not a GPU\"}" \
    >>"$OUT_DIR/phases.jsonl"
fi
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
bench, scale = out / "bench_core.json", out / "scale.json"
summary = {
    "environment": json.loads((out / "environment.json").read_text()),
    "phases": [json.loads(l) for l in (out / "phases.jsonl").read_text().splitlines()],
    "quickstart": rows("quickstart"),
    "batch_breakeven": rows("batch_breakeven"),
    "bench_core": json.loads(bench.read_text()) if bench.exists() else None,
    "scale": json.loads(scale.read_text()) if scale.exists() else None,
}
(out / "device_check.json").write_text(json.dumps(summary, indent=1))
print(f"device_check: wrote {out / 'device_check.json'}")
PYEOF
