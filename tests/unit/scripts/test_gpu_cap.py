"""scripts/peer/gpu_cap: with GPU_MEMORY_CAP_GIB set, every process that imports torch.cuda gets
a set_device that caps its allocator; without it, torch.cuda is untouched."""

import os
import subprocess
import sys

PROBE = "import torch, torch.cuda; print(torch.cuda.set_device.__name__)"


def _probe(cap: str | None) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["scripts/peer/gpu_cap", *sys.path]))
    env.pop("GPU_MEMORY_CAP_GIB", None)
    if cap is not None:
        env["GPU_MEMORY_CAP_GIB"] = cap
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_cap_wraps_set_device_only_when_asked():
    assert _probe("79.1") == "set_device_capped"
    assert _probe(None) == "set_device"
