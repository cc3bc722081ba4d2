"""The trainer and scripts/bench.py run under the same CUDA allocator setting, so that bench's
reserved memory is the one training sees; a setting the user exported is kept."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_ablate.cuda_allocator import ALLOC_CONF

ROOT = Path(__file__).resolve().parents[3]
IMPORT = {
    "trainer": "import torchtitan_ablate.train",
    "bench": f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import bench",
}


def _setting_after_import(program: str, user_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    if user_value is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = user_value
    code = f"{IMPORT[program]}; import os; print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("program", sorted(IMPORT))
def test_sets_the_allocator_setting_before_torch(program):
    assert _setting_after_import(program, None) == ALLOC_CONF


@pytest.mark.parametrize("program", sorted(IMPORT))
def test_keeps_the_users_setting(program):
    assert _setting_after_import(program, "garbage_collection_threshold:0.8") == (
        "garbage_collection_threshold:0.8"
    )
