"""Caps each training process's CUDA caching allocator at GPU_MEMORY_CAP_GIB, so that a recipe
named for an 80 GB H100 can be measured on a larger card (an H200) as it would run on the H100.

peer_bench.sh puts this folder on PYTHONPATH when GPU_MEMORY_CAP_GIB is set; Python then imports
this file at start-up in every process, torchtitan's and this project's alike. The cap is set
when a process picks its GPU (torch.cuda.set_device, which both engines call once per rank), not
at import: compile workers and tools that never pick a GPU create no CUDA context."""

import importlib.abc
import importlib.machinery
import os
import sys

_CAP_GIB = float(os.environ.get("GPU_MEMORY_CAP_GIB", "0") or 0)


class _CapOnSetDevice(importlib.abc.MetaPathFinder):
    """Wraps torch.cuda.set_device once torch.cuda is imported (an import hook: torch is not
    imported here, most processes never need it)."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name != "torch.cuda":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module) -> None:  # noqa: ANN001
            exec_module(module)
            set_device = module.set_device

            def set_device_capped(device) -> None:  # noqa: ANN001
                set_device(device)
                index = module.current_device()
                total = module.get_device_properties(index).total_memory
                fraction = min(1.0, _CAP_GIB * 2**30 / total)
                module.set_per_process_memory_fraction(fraction, index)
                print(
                    f"[gpu_cap] cuda:{index}: allocator capped at {_CAP_GIB:.1f} GiB "
                    f"({fraction:.3f} of {total / 2**30:.1f} GiB)",
                    file=sys.stderr,
                    flush=True,
                )

            module.set_device = set_device_capped

        spec.loader.exec_module = exec_and_wrap
        return spec


if _CAP_GIB > 0:
    sys.meta_path.insert(0, _CapOnSetDevice())
