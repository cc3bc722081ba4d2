"""The [debug] section (torchtitan's name): switches that change what a run computes, for
benchmarks and debugging only. Field docstrings are the reference text, as in job_config.py."""

from dataclasses import dataclass


@dataclass
class Debug:
    moe_force_load_balance: bool = False
    """Benchmarks only: every MoE layer routes its tokens round-robin instead of by the router
    (torchtitan's key of the same name; NeMo AutoModel's fake balanced gate, Megatron's
    --moe-router-force-load-balancing), so each expert gets T*K/E rows (floor or ceil) and
    throughput compares across engines without routing imbalance. Each token's K experts are
    spread over the expert ids (under EP it reaches min(EP degree, K) ranks). The router weights
    still scale the chosen experts; the load-balancing loss and the expert bias have nothing to
    act on and are refused, and so is checkpoint.enable: weights trained this way route
    differently in any normal run or HF export. The metrics and the console mark such runs."""
