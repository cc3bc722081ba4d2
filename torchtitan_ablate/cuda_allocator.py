"""The CUDA caching allocator's setting, for every program that runs training steps.

The trainer and scripts/bench.py put it in PYTORCH_CUDA_ALLOC_CONF before torch's first CUDA
allocation (unless the user set one), so that the reserved memory bench reports is the one
training sees (bench without it reserved 73.4 GiB for the one-GPU MoE recipe's 70.9 GiB active
peak, with it 72.4); the estimator's allocator factors are measured with it.
"""

# Growable segments instead of fixed blocks: a run near the memory limit (Qwen3-4B with AdamW
# on one 80 GB GPU) does not stall on fragmentation retries, and the MoE's routing-sized
# buffers reuse freed memory.
ALLOC_CONF = "expandable_segments:True"
