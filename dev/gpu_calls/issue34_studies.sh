#!/usr/bin/env bash
# Issue 34's two studies on 4 GPUs (carry .whl), in parts across calls: the runner resumes
# (--resume) and runs the variants named by ONLY (comma-separated) this call. The runs and the
# report come back under $OUT/<study>; keep them in results/ablations/<study>/ as the other
# studies are. STUDY=tp_vs_fsdp|pp_schedules.
set -uo pipefail
source dev/gpu_calls/common.sh
STUDY=${STUDY:?STUDY=tp_vs_fsdp|pp_schedules}
EXTRA=""; [ "$STUDY" = pp_schedules ] && EXTRA="--skip-invalid"   # ZBV needs torch 2.13
run study 585 python3 scripts/ablate.py "train_configs/ablations/$STUDY.toml" --out "$OUT/$STUDY" \
  --resume ${ONLY:+--only "$ONLY"} $EXTRA
tail -n 30 "$OUT/study.log"
