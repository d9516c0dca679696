#!/usr/bin/env bash
# Build the shipped embedded pair by its recipe (tokenizer, target, draft, EAGLE and Medusa
# heads: the 'shipped' preset on the code+tests corpus) and export it in the layout
# specjax/embedded/ holds (training/shipped.py). Meant for an accelerator: minutes on one GPU.
#
#   bash benchmarks/train_shipped.sh OUT_DIR [STDLIB_TGZ]
#
# STDLIB_TGZ: a tarball of another interpreter's standard library (.py files, paths relative
# to its root), so the pair trains on exactly the text that Python version carries (the
# shipped pair: CPython 3.11's); without it, the running interpreter's library. Writes
# OUT_DIR/shipped.tar.NN (the export, in chunks of at most 15 MB) and OUT_DIR/train.log.
# Install the result with:  cat OUT_DIR/shipped.tar.* | tar xf - -C specjax/embedded/shipped-code+tests
set -uo pipefail
OUT_DIR=${1:?usage: train_shipped.sh OUT_DIR [STDLIB_TGZ]}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PY=${PYTHON:-python3}
WORK=${SHIPPED_WORK:-/tmp/specjax_shipped}
mkdir -p "$WORK"
export SPECJAX_CACHE_DIR=$WORK/cache PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${2:-}" ]; then
  mkdir -p "$WORK/stdlib" && tar xzf "$2" -C "$WORK/stdlib" || exit 2
  export SPECJAX_STDLIB_DIR=$WORK/stdlib
fi
rm -rf "$WORK/export"
"$PY" - "$WORK/export" >"$OUT_DIR/train.log" 2>&1 <<'PYEOF'
import sys, time
t0 = time.time()
from specjax.training import export_shipped
m = export_shipped.export("shipped", "code+tests", sys.argv[1], progress=False)
print({k: m[k] for k in ("device", "jax", "python", "export_seconds")}, flush=True)
for role in ("target", "draft"):
  print(role, m[role]["trained"].get("build_seconds"), m[role]["trained"][role].get("val"))
for kind, h in m["heads"].items():
  print(kind, h["trained"].get("build_seconds"), h["trained"].get("acceptance"))
print(f"total {time.time() - t0:.1f} s")
PYEOF
rc=$?
tail -n 30 "$OUT_DIR/train.log"
[ $rc -eq 0 ] || exit $rc
tar cf - -C "$WORK/export" . | split -b 15m -d - "$OUT_DIR/shipped.tar."
ls -la "$OUT_DIR"
