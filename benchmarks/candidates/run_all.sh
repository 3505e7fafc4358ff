#!/bin/sh
# The matrix behind README's tables: per regime and load, every candidate in both loop modes
# (one database per run, C0 first as the same-run baseline), then C3/C4 with the lazy settle
# against C0 (whose lazy mode is its event mode), then the drains and the CHECK micro-benchmark.
set -e
PY=${PY:-../../.venv/bin/python}
SECS=${SECS:-10}
TAG=${TAG:-matrix}
for regime in fresh analyzed; do
  for load in 100x1 1000x10; do
    $PY bench.py loop --regime $regime --load $load --secs $SECS --cands C0,C1p,C1f,C3,C4,C4c --modes poll,event --tag $TAG
    $PY bench.py loop --regime $regime --load $load --secs $SECS --cands C0,C3,C4,C4c --modes lazy --tag $TAG-lazy
  done
done
$PY bench.py drain --regime fresh --cands C0,C1p,C3,C4,C4c --tag $TAG
$PY checks.py 500
