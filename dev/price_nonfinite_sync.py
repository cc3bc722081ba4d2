"""Measuring tool only: the trainer with the non-finite check's values read before the update
(the host sync each step, as with a non-fused optimizer) instead of on the device and a step
late (fused, the default on CUDA), to price that sync. Same arguments as torchtitan_ablate.train:

    python3 dev/price_nonfinite_sync.py --job.config_file train_configs/qwen3_0.6b.toml ...
"""

import torchtitan_ablate.train as t
from torchtitan_ablate.components.optim.optimizer import LocalShardAdamW

LocalShardAdamW.skips_on_device = property(lambda self: False)  # read every step before update
t.run_main(t.main)
