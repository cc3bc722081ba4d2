"""MemoryTracker: live bytes per category over one training step, and their peak.

The principle of torch.distributed._tools' MemTracker, made cheap enough for 48-layer models:
a TorchDispatchMode sees every op's outputs; each new storage is counted once (by identity, with
a weakref whose callback uncounts it when it is freed); `UntypedStorage.resize_` is patched
because FSDP2 frees and re-allocates unsharded parameters by resizing their storage. The peak is
the largest total seen after any op. It works the same on fake and on real tensors, which is
how the estimator is checked against real CPU runs.

Categories (assigned when a storage first appears, moved when its role becomes known):
  parameters            sharded (or plain) parameters present when tracking starts
  buffers               module buffers (RoPE tables, expert-load counters)
  optimizer_states      optimizer state present when tracking starts (Adam moments, step)
  unsharded_parameters  FSDP2's all-gathered parameters (storages grown by resize_)
  gradients             storages that end up as a parameter's .grad
  activations           allocated during forward (incl. the loss, and AC recompute in backward)
  temporaries           allocated in backward or the optimizer step, not kept as gradients
  communication         collective outputs: FSDP all-gather / reduce-scatter, EP all-to-all,
                        CP all-gather buffers
  inputs                the batch
"""

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.fsdp import fully_shard  # noqa: F401  (registers torch.ops.fsdp)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

CATEGORIES = (
    "parameters",
    "buffers",
    "optimizer_states",
    "unsharded_parameters",
    "gradients",
    "activations",
    "temporaries",
    "communication",
    "inputs",
)
_COMM_NAMESPACES = ("_c10d_functional", "c10d", "fsdp")
_WRAPPERS = ("._checkpoint_wrapped_module", "._orig_mod")
# Wrapper subclasses (DTensor, funcol's AsyncCollectiveTensor) own no memory of their own.
_PLAIN = (torch.Tensor, nn.Parameter)
# FSDP2 copies the all-gather output into the unsharded parameters (allocated with plain
# aten.empty just before) with this op; its `out` tensors are what forward/backward compute with.
_FSDP_COPY_OUT = torch.ops.fsdp.split_with_sizes_copy.default


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages that hold `t`'s data: a DTensor's local shard, and the inner tensors of
    wrapper subclasses (torchao's float8 all-gather weights wrap the fp32 shard); a wrapper's
    own storage is empty, so counting it would drop the parameters from the estimate."""
    t = _local(t)
    if not is_traceable_wrapper_subclass(t):
        return [t.untyped_storage()]
    names, _ = t.__tensor_flatten__()
    return [st for name in names for st in _storages(getattr(t, name))]


def _strip_wrappers(name: str) -> str:
    for part in _WRAPPERS:
        name = name.replace(part, "")
    return name


class _Info:
    __slots__ = ("nbytes", "category", "module")

    def __init__(self, nbytes: int, category: str, module: str) -> None:
        self.nbytes, self.category, self.module = nbytes, category, module


class MemoryTracker(TorchDispatchMode):
    """Use: tracker.track_model(parts, optimizer); tracker.track_inputs(batches); with tracker:
    step. Then `peak`, `peak_by_category`, `peak_where` and `module_activations`.

    round_bytes: round every storage up to this multiple (512 models the CUDA caching allocator).

    Compiled regions: the tracker is transparent to torch.compile (`ignore_compile_internals`),
    so dynamo traces the real program and the tracker sees what the compiled graphs run;
    estimator/compiled.py runs them with `uncounted()` around the ops Inductor fuses away.
    """

    _active: "MemoryTracker | None" = None

    def __init__(self, round_bytes: int = 1) -> None:
        super().__init__()
        self.round_bytes = round_bytes
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.peak = 0
        self.peak_by_category = dict(self.live)
        self.peak_where = "start"
        self.module_activations: dict[str, int] = {}
        self._known: dict[int, tuple[weakref.ref, _Info]] = {}
        self._names: dict[int, str] = {}
        self._stack: list[str] = []
        self._roots: set[int] = set()
        self._after_backward = True  # until the first forward: step-level temporaries
        self._handles: list = []
        self._fake_on_entry = None
        self._propagating = False
        self._uncounted = False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    @classmethod
    def active(cls) -> "MemoryTracker | None":
        """The tracker of the step being tracked, if any."""
        return cls._active

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Ops run inside allocate nothing that is counted (values fused into a kernel)."""
        saved, self._uncounted = self._uncounted, True
        try:
            yield
        finally:
            self._uncounted = saved

    # ---- registration ---------------------------------------------------------------------------

    def track_model(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> None:
        """Counts what exists before the step and hooks gradients and module boundaries. parts:
        the rank's model parts (the model itself, or its pipeline stages: their modules keep
        the whole model's names)."""
        self._roots = {id(part) for part in parts}
        self._names = {id(m): _strip_wrappers(n) for part in parts for n, m in part.named_modules()}
        for p in (p for part in parts for p in part.parameters()):
            for st in _storages(p):
                self._add(st, "parameters")
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        for b in (b for part in parts for b in part.buffers()):
            for st in _storages(b):
                self._add(st, "buffers")
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    for st in _storages(v):
                        self._add(st, "optimizer_states")

    def track_frozen(self, module: nn.Module) -> None:
        """Counts the weights and buffers of a module the step runs but does not train (DPO's
        reference copy) as parameters and buffers."""
        for p in module.parameters():
            for st in _storages(p):
                self._add(st, "parameters")
        for b in module.buffers():
            for st in _storages(b):
                self._add(st, "buffers")

    def track_inputs(self, batches: list[dict]) -> None:
        for batch in batches:
            for v in batch.values():
                if isinstance(v, torch.Tensor):
                    self._add(v.untyped_storage(), "inputs")

    # ---- bookkeeping ----------------------------------------------------------------------------

    def _round(self, nbytes: int) -> int:
        r = self.round_bytes
        return (nbytes + r - 1) // r * r

    def _add(self, st: torch.UntypedStorage, category: str, module: str = "") -> None:
        key = id(st)
        if key in self._known:
            return
        info = _Info(self._round(st.nbytes()), category, module)
        self._known[key] = (weakref.ref(st, partial(self._on_free, key)), info)
        self.live[category] += info.nbytes
        self.total += info.nbytes

    def _on_free(self, key: int, _ref: weakref.ref) -> None:
        entry = self._known.pop(key, None)
        if entry is not None:
            info = entry[1]
            self.live[info.category] -= info.nbytes
            self.total -= info.nbytes

    def _move(self, st: torch.UntypedStorage, category: str) -> None:
        entry = self._known.get(id(st))
        if entry is None:
            self._add(st, category)
            return
        info = entry[1]
        self.live[info.category] -= info.nbytes
        self.live[category] += info.nbytes
        info.category = category

    def _resized(self, st: torch.UntypedStorage) -> None:
        entry = self._known.get(id(st))
        if entry is None:
            self._add(st, "unsharded_parameters")
        else:
            info = entry[1]
            new = self._round(st.nbytes())
            self.live[info.category] -= info.nbytes
            self.total += new - info.nbytes
            info.nbytes, info.category = new, "unsharded_parameters"
            self.live[info.category] += new
        self._update_peak()

    def _update_peak(self) -> None:
        if self.total > self.peak:
            self.peak = self.total
            self.peak_by_category = dict(self.live)
            if torch._C._current_graph_task_id() != -1:
                phase = "backward"
            elif self._stack:
                phase = "forward"
            else:
                phase = "optimizer step" if self._after_backward else "loss"
            self.peak_where = f"{phase} {self._stack[-1] if self._stack else ''}".strip()

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            for st in _storages(p.grad):
                self._move(st, "gradients")

    # ---- module boundaries (global hooks) -------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args) -> None:
        if torch.compiler.is_compiling():
            return  # inside a compiled block: traced as a no-op (no guard on the module's id)
        name = self._names.get(id(module))
        if name is None:
            return
        if id(module) in self._roots and torch._C._current_graph_task_id() == -1:
            self._after_backward = False
        self._stack.append(name)

    def _post_forward(self, module: nn.Module, args, out) -> None:
        if torch.compiler.is_compiling():
            return
        if id(module) not in self._names or not self._stack:
            return
        self._stack.pop()
        if id(module) in self._roots and torch._C._current_graph_task_id() == -1:
            self._snapshot_module_activations()

    def _snapshot_module_activations(self) -> None:
        per_module: dict[str, int] = {}
        for _, info in self._known.values():
            if info.category == "activations":
                per_module[info.module] = per_module.get(info.module, 0) + info.nbytes
        self.module_activations = per_module

    # ---- dispatch -------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        fake = active_fake_mode()
        if func is torch.ops._c10d_functional.wait_tensor.default and fake is not None:
            return args[0]  # the fake kernel returns a new tensor; eager waits in place
        out = func(*args, **(kwargs or {}))
        if fake is not self._fake_on_entry or self._propagating or self._uncounted:
            return out  # DTensor's shape propagation on global shapes: nothing is allocated
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward:
            self._after_backward = True
        if func.namespace in _COMM_NAMESPACES:
            category = "communication"
        elif self._stack or not self._after_backward:
            category = "activations"
        else:
            category = "temporaries"
        if func is _FSDP_COPY_OUT:  # out= are the unsharded parameters
            for t in kwargs["out"]:
                self._move(t.untyped_storage(), "unsharded_parameters")
        module = self._stack[-1] if self._stack else ""
        for t in tree_flatten(out)[0]:
            if type(t) in _PLAIN or isinstance(t, FakeTensor):
                self._add(t.untyped_storage(), category, module)
        self._update_peak()
        return out

    def __enter__(self) -> "MemoryTracker":
        self._fake_on_entry = active_fake_mode()
        self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st: torch.UntypedStorage, size: int):
            out = tracker._orig_resize(st, size)
            tracker._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        # DTensor derives output metadata by running the op on global-shape tensors under the
        # active fake mode (ours, when estimating): those are not allocations of this rank.
        self._orig_propagate = ShardingPropagator._propagate_tensor_meta_non_cached

        def propagate(prop, *args, **kwargs):
            tracker._propagating = True
            try:
                return tracker._orig_propagate(prop, *args, **kwargs)
            finally:
                tracker._propagating = False

        ShardingPropagator._propagate_tensor_meta_non_cached = propagate
        self._handles += [
            nn.modules.module.register_module_forward_pre_hook(self._pre_forward),
            nn.modules.module.register_module_forward_hook(self._post_forward, always_call=True),
        ]
        self.peak, self.peak_by_category = self.total, dict(self.live)
        MemoryTracker._active = self
        return super().__enter__()

    def __exit__(self, *args) -> None:
        super().__exit__(*args)
        MemoryTracker._active = None
        torch.UntypedStorage.resize_ = self._orig_resize
        ShardingPropagator._propagate_tensor_meta_non_cached = self._orig_propagate
        for h in self._handles:
            h.remove()
        self._handles.clear()
