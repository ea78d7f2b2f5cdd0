"""The main job's summary lines for the routing extensions (shared experts, loss-free bias
balancing, the sigmoid router): what an MoE run used, read from its checkpoint, and how the run with
them compares with the same MoE without them (``moe_base``, trained when SHARED_EXPERTS or BALANCE
is set)."""

BIAS_SUFFIX = ".balance_bias.bias"


def routing_features(model_cfg, model_state: dict) -> dict:
    """Shared experts, balance method, router and the final balance biases of a checkpoint."""
    biases = {k: v for k, v in model_state.items() if k.endswith(BIAS_SUFFIX)}
    spread = max((float(v.max() - v.min()) for v in biases.values()), default=None)
    return {
        "shared_experts": int(getattr(model_cfg, "moe_shared_expert_count", 0) or 0),
        "balance": str(getattr(model_cfg, "moe_balance", "none") or "none"),
        "router": str(getattr(model_cfg, "moe_router", "top")),
        "bias_spread": spread,  # max - min of a layer's bias, largest over layers
    }


def describe_features(run: dict) -> str:
    f = run["features"]
    parts = [f"router {f['router']}"]
    parts.append(f"{f['shared_experts']} shared expert(s)" if f["shared_experts"] else "no shared experts")
    if f["balance"] == "bias":
        parts.append(f"loss-free bias balancing (final bias spread {f['bias_spread']:.4f})")
    return ", ".join(parts)


def effect_lines(moe: dict, base: dict) -> list:
    """``moe`` (with the extensions) against ``base`` (the same MoE without them)."""

    def imbalance(run):
        return run["last"].get("moe_imbalance", "?")

    gain = moe["bleu"]["bleu"] - base["bleu"]["bleu"]
    return [
        "",
        f"routing extensions: {moe['name']} ({describe_features(moe)}) vs {base['name']} ({describe_features(base)}):",
        f"  {gain:+.2f} BLEU; imbalance over the last log interval {imbalance(moe)} vs {imbalance(base)} "
        f"(1.0 = balanced); balance loss {moe['last'].get('moe_gate_loss', '?')} vs {base['last'].get('moe_gate_loss', '?')}",
        f"  active parameters per token {moe['active']:,} vs {base['active']:,}; FLOPs per token "
        f"{moe['flops']:,} vs {base['flops']:,} (shared experts run on every token)",
    ]
