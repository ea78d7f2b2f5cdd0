"""Run fairseq's inference entry points in one process (several runs one after another) and record, while each
runs, the dtypes the MoE model actually computed in: what forward hooks saw, not what a flag said.

Usage (under torchrun, one worker or several): python tests/support/probes/fairseq_dtype_probe.py OUT_DIR RUNS_JSON [ARGS]
RUNS_JSON maps a run's name to {"tool": "generate" | "interactive" | "validate" | "eval_lm", "args": [...]}, whose
command line gets ARGS appended (torchrun's --distributed-world-size), or to {"tool": "hub", "dir", "checkpoint_file",
"data", "overrides": {...}, "sentence"}: MoETransformerModel.from_pretrained(dir, ..., **overrides).translate(sentence).
Run NAME writes OUT_DIR/NAME/rank{R}.json: {"seen": {what: [dtype names]}, "forwards": MoE layer calls, "allocated":
[[dtype, shape] of each 3-D floating tensor allocated while the model loaded]} where what is experts / moe_input /
router_logits / balance_bias / attention_weights / attention_input / output_logits.
"""

import json
import os
import sys
from collections import defaultdict


def main():
    out_dir, runs, common = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
    import fairseq_moe_ext  # noqa: F401  (its hooks first: the recorder below wraps the plugin's load)
    from fairseq import checkpoint_utils

    rank = int(os.environ.get("RANK", "0"))
    record = {}
    plugin_load = checkpoint_utils.load_model_ensemble_and_task

    def load_model_ensemble_and_task(*args, **kwargs):
        with AllocationRecorder(record["allocated"]):
            loaded = plugin_load(*args, **kwargs)
        for model in loaded[0]:
            watch(model, record)
        return loaded

    checkpoint_utils.load_model_ensemble_and_task = load_model_ensemble_and_task
    for name, run in runs.items():
        record.clear()
        record.update(seen=defaultdict(set), forwards=0, allocated=[])
        if run["tool"] == "hub":
            translate_with_hub(run)
        else:
            run_cli(run["tool"], [*run["args"], *common])
        os.makedirs(os.path.join(out_dir, name), exist_ok=True)
        seen = {what: sorted(dtypes) for what, dtypes in record["seen"].items()}
        with open(os.path.join(out_dir, name, f"rank{rank}.json"), "w") as f:
            json.dump({"seen": seen, "forwards": record["forwards"], "allocated": record["allocated"]}, f)


def run_cli(tool, argv):
    import importlib

    module = importlib.import_module(f"fairseq_cli.{tool}")
    sys.argv = [f"fairseq-{tool.replace('_', '-')}", *argv]
    module.cli_main()


def translate_with_hub(run):
    from fairseq_moe_ext.models.moe_transformer import MoETransformerModel

    hub = MoETransformerModel.from_pretrained(
        run["dir"], checkpoint_file=run["checkpoint_file"], data_name_or_path=run["data"], **run["overrides"]
    )
    assert isinstance(hub.translate(run["sentence"]), str)


ALLOCATING = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "zeros", "_to_copy", "clone",
              "cat", "contiguous"}  # fmt: skip


def AllocationRecorder(allocated):
    """A TorchDispatchMode appending [dtype, shape] of every 3-D floating CPU tensor an op allocates (experts are the
    model's only 3-D parameters; tensors a memory-mapped torch.load makes are views of the file, not allocations)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in ALLOCATING and torch.is_tensor(out):
                if out.dim() == 3 and out.is_floating_point() and out.device.type == "cpu":
                    allocated.append([dtype_name(out), list(out.shape)])
            return out

    return Recorder()


def dtype_name(tensor):
    return str(tensor.dtype).replace("torch.", "")


def watch(model, record):
    """Forward hooks on ``model`` recording the dtypes its MoE layers, attention and output projection ran in."""
    from fairseq.modules import MultiheadAttention

    from fairseq_moe_ext.moe import MoELayer

    seen = record["seen"]

    def moe_input(layer, args):
        record["forwards"] += 1
        seen["moe_input"].add(dtype_name(args[0]))
        seen["experts"].update(dtype_name(p) for p in layer.experts.parameters())
        bias = layer.router.balance_bias
        if bias is not None:
            seen["balance_bias"].add(dtype_name(bias.bias))

    def router_output(router, args, output):
        seen["router_logits"].add(dtype_name(output.logits))

    def attention_input(attention, args, kwargs):
        query = kwargs.get("query", args[0] if args else None)
        seen["attention_input"].add(dtype_name(query))
        seen["attention_weights"].update(dtype_name(p) for p in attention.parameters())

    def output_logits(projection, args, output):
        seen["output_logits"].add(dtype_name(output))

    for module in model.modules():
        if isinstance(module, MoELayer):
            module.register_forward_pre_hook(moe_input)
            module.router.register_forward_hook(router_output)
        elif isinstance(module, MultiheadAttention):
            module.register_forward_pre_hook(attention_input, with_kwargs=True)
    decoder = getattr(model, "decoder", None)
    projection = getattr(decoder, "output_projection", None)
    if projection is not None:
        projection.register_forward_hook(output_logits)


if __name__ == "__main__":
    main()
