# Sourced by the dev/gpu_calls scripts on the device machine, from the repository root: the
# carried wheels (.whl, scripts/device_setup.sh), NVLink multicast off (the device's KINDS.md),
# the card and commit in the output, and the benchmark corpus built once.
source scripts/device_setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
git log --oneline -1 2>/dev/null || true
python3 scripts/make_bench_corpus.py --out outputs/bench_corpus 2>&1 | tail -1
OUT=${OUT:-outputs/gpu_calls}
mkdir -p "$OUT"
T0=$(date +%s)
# run NAME LIMIT_S CMD...: CMD's output to $OUT/NAME.log, skipped when the call's 590 s would pass
run() {
  local name=$1 lim=$2; shift 2
  if [ $(( $(date +%s) - T0 + lim )) -gt 590 ]; then echo "== $name skipped (call time)"; return; fi
  local t=$(date +%s)
  timeout "$lim" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t )) s"
}
