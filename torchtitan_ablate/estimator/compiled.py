"""The compiled program on fake tensors: torch.compile's graphs as Inductor gets them, run with
Inductor's buffers.

`FakeInductor()` is a torch.compile backend (build.BuildOptions.compile_backend) that does
what Inductor does up to code generation -- AOTAutograd traces the joint forward/backward graph
with Inductor's decompositions, Inductor's own `partition_fn` (its joint-graph passes, then
min-cut rematerialisation) decides what the forward saves for backward -- and instead of
generating kernels returns a `GraphRunner`: the partitioned graph run node by node on the
tracker's fake tensors. So the saved activations are exactly those the partitioner keeps.

What Inductor allocates inside a graph is modelled by which nodes it *realizes* as buffers
(`realized_nodes`); the others are fused into their consumers and allocate nothing:
  - views alias their base (no buffer);
  - pointwise ops, factories and indexed loads fuse into their consumers;
  - a node is a buffer when it is a graph output (the forward's outputs include the saved
    tensors; the backward's are the gradients), an extern kernel or fallback (mm, attention,
    grouped mm, collectives, ops Inductor cannot lower), a reduction, a scatter / cat / sort /
    mutation, an input of an extern kernel, or a pointwise node read by several consumers whose
    fused body reads more than `_REALIZE_READS` buffers or spans more than `_REALIZE_OPS` ops
    (Inductor's realize_reads_threshold and realize_opcount_threshold);
  - a buffer lives from its node until the last kernel that reads it (Inductor frees after the
    last read; the backward frees each saved tensor so, as its boxed calling convention lets
    it). A fused node is read where its consumers' kernels run, not where it stands in the
    graph: the plain loss's backward reads the saved logits in the kernel that writes their
    gradient, so both are live together.
Not modelled: Inductor writing a pointwise kernel's output into a dead input's buffer
(`inplace_buffers`), which lowers a transient peak by at most one buffer; and its reordering of
kernels for peak memory. Both make the estimate lean high, never low.
"""

import operator
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd

from torchtitan_ablate.config.derived import compiles, resolved_loss_impl
from torchtitan_ablate.estimator.tracker import MemoryTracker

_REALIZE_READS = 4  # torch._inductor.config.realize_reads_threshold
_REALIZE_OPS = 30  # torch._inductor.config.realize_opcount_threshold
_FUSED_NON_POINTWISE = {  # lowered as loads/index math inside the consumer's kernel
    torch.ops.aten.full.default,
    torch.ops.aten.scalar_tensor.default,
    torch.ops.aten.arange.start_step,
    torch.ops.aten.arange.default,
    torch.ops.aten.arange.start,
    torch.ops.prims.iota.default,
    torch.ops.aten.index.Tensor,
    torch.ops.aten.gather.default,
    torch.ops.aten.embedding.default,
    torch.ops.aten.expand.default,
}


def _is_view(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _is_fusible(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in target.tags or target in _FUSED_NON_POINTWISE


def _needs_realized_inputs(node: fx.Node) -> bool:
    from torch._inductor import lowering

    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return True  # higher-order ops and Python callables run as opaque kernels
    return (
        target in lowering.needs_realized_inputs
        or target in lowering.fallbacks
        or target not in lowering.lowerings
    )


def _base(node: fx.Node) -> fx.Node:
    while _is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        if node.target is operator.getitem and not _is_view(node.args[0]):
            return node  # an element of a multi-output kernel is its own buffer
        node = node.args[0]
    return node


def realized_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The compute nodes whose outputs Inductor materialises as buffers (module docstring)."""
    realized: set[fx.Node] = set()
    compute = [n for n in graph.nodes if n.op in ("call_function", "call_module")]
    for node in compute:
        if _is_view(node):
            continue
        if not _is_fusible(node):
            realized.add(node)
        if _needs_realized_inputs(node):
            for arg in node.all_input_nodes:
                realized.add(_base(arg))
    for node in graph.find_nodes(op="output"):
        for arg in node.all_input_nodes:
            realized.add(_base(arg))
    # Pointwise nodes read by several kernels: inlined into each unless too heavy to repeat.
    reads: dict[fx.Node, tuple[set, int]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or _is_view(node) or node in realized:
            continue
        inputs, ops = set(), 1
        for arg in node.all_input_nodes:
            base = _base(arg)
            if base in reads and base not in realized:
                inputs |= reads[base][0]
                ops += reads[base][1]
            else:
                inputs.add(base)
        reads[node] = (inputs, ops)
        if len(node.users) > 1 and (len(inputs) > _REALIZE_READS or ops > _REALIZE_OPS):
            realized.add(node)
    return {n for n in realized if n.op in ("call_function", "call_module")}


def _kernel_last_use(nodes: list[fx.Node], realized: set[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Each value's last reader in kernel order: a fused node (and a view) is evaluated inside
    its consumers' kernels, so its inputs are read when the last of those runs."""
    position = {node: i for i, node in enumerate(nodes)}
    runs_at: dict[fx.Node, fx.Node] = {}  # the node whose kernel computes this one
    for node in reversed(nodes):
        later = [runs_at[u] for u in node.users if u in runs_at]
        if node in realized or node.op == "output" or not later:
            runs_at[node] = node
        else:
            runs_at[node] = max(later, key=position.__getitem__)
    last_use: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            use = runs_at[node]
            if arg not in last_use or position[use] > position[last_use[arg]]:
                last_use[arg] = use
    return last_use


class GraphRunner:
    """Runs a partitioned graph on fake tensors, counting only Inductor's buffers.

    Boxed calling convention (as Inductor's compiled graphs): the argument list is cleared on
    entry, so each input (a saved activation, in backward) is freed after its last use."""

    def __init__(self, gm: fx.GraphModule) -> None:
        # An instance attribute: dynamo's disable() wrapper copies __dict__ (functools.wraps).
        self._boxed_call = True
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        realized = realized_nodes(gm.graph)
        # A view is counted with its base: computed uncounted when the base is fused away.
        self.counted = {n for n in self.nodes if _base(n) in realized}
        last_use = _kernel_last_use(self.nodes, realized)
        self.free_after: dict[fx.Node, list[fx.Node]] = {n: [] for n in self.nodes}
        for node in self.nodes:
            if node.op != "output":
                self.free_after[last_use.get(node, node)].append(node)

    def __call__(self, args: list) -> tuple:
        inputs = list(reversed(args))
        args.clear()
        env: dict[fx.Node, object] = {}
        tracker = MemoryTracker.active()
        for node in self.nodes:
            if node.op == "placeholder":
                env[node] = inputs.pop()
            elif node.op == "output":
                return fx.node.map_arg(node.args[0], env.__getitem__)
            else:
                fn_args = fx.node.map_arg(node.args, env.__getitem__)
                fn_kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
                fn = self._callable(node)
                fused = tracker is not None and node not in self.counted
                with tracker.uncounted() if fused else nullcontext():
                    env[node] = fn(*fn_args, **fn_kwargs)
            for dead in self.free_after[node]:
                env.pop(dead, None)
        raise RuntimeError("graph without an output node")

    def _callable(self, node: fx.Node) -> Callable:
        if node.op == "call_function":
            return node.target
        if node.op == "call_module":
            return self.gm.get_submodule(node.target)
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(self.gm)
            return lambda: value
        raise NotImplementedError(f"graph node {node.op} {node.target}")


def _compile_graph(gm: fx.GraphModule, example_inputs) -> GraphRunner:
    return GraphRunner(gm)


class FakeInductor:
    """torch.compile backend: Inductor's decompositions and partitioner, GraphRunner instead
    of generated kernels. Counts the graphs dynamo hands it (one per distinct block shape and
    graph-break segment: identical blocks reuse dynamo's cached graphs)."""

    def __init__(self) -> None:
        from torch._inductor.compile_fx import partition_fn
        from torch._inductor.decomposition import select_decomp_table

        self.graphs = 0
        self._aot = aot_autograd(
            fw_compiler=_compile_graph,
            bw_compiler=_compile_graph,
            inference_compiler=_compile_graph,
            partition_fn=partition_fn,
            decompositions=select_decomp_table(),
            keep_inference_input_mutations=True,
        )

    def __call__(self, gm: fx.GraphModule, example_inputs) -> Callable:
        self.graphs += 1
        return self._aot(gm, example_inputs)


def describe_program(config, graphs: int) -> str:
    """Which parts of the step are compiled (modelled as above) and which run eager."""
    if not config.compile.enable:
        return "program: eager (compile.enable = false)"
    impl = resolved_loss_impl(config.training)
    compiled, eager = [], ["embeddings", "final norm", "optimizer step"]
    parts = [("model", "transformer blocks"), ("loss", f"{impl} loss")]
    for part, what in parts:
        fused_kernel = part == "loss" and impl not in ("chunked", "plain")
        (compiled if compiles(config.compile, part) and not fused_kernel else eager).append(what)
    return (
        f"program: compiled {', '.join(compiled) or 'nothing'} ({graphs} graphs traced, "
        "Inductor modelled on fake tensors: AOTAutograd partition, fused pointwise ops); "
        f"eager {', '.join(eager)}"
    )
