"""A checkpoint that holds a model's config and the shape of every tensor, but no weights (each tensor a stride-0
view of one zero): what ``python -m fairseq_moe_ext plan ... --criterion moe_distillation --distill-teacher`` reads
of a teacher (its cfg and its embeddings' sizes), so that a teacher not yet downloaded, such as NLLB-200 MoE 54.5B,
can be planned for. The model is built from fairseq-train's arguments on the ``meta`` device, as plan builds it.
Not a checkpoint to load: its weights are all zero.

  python recipes/shape_only_checkpoint.py teacher-shapes.pt <the teacher's fairseq-train arguments> \
      [--dictionary-size N]
"""

import sys

import torch
from omegaconf import OmegaConf

from fairseq_moe_ext.moe.experts import is_expert
from fairseq_moe_ext.training.plan_model import build_task_and_model


def shape_only_state(argv, dictionary_size=None) -> dict:
    cfg, _, _, model = build_task_and_model(argv, dictionary_size)
    tensors = {name: torch.zeros(1, dtype=t.dtype).expand(t.shape) for name, t in model.state_dict().items()}
    experts = [name for name, p in model.named_parameters() if is_expert(p)]
    state = {"cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "model": tensors, "args": None}
    if experts:
        state["moe"] = {"expert_keys": experts}
    return state


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2:
        raise SystemExit(__doc__.strip().splitlines()[-2].strip())
    out, rest = argv[0], argv[1:]
    size = None
    if "--dictionary-size" in rest:
        i = rest.index("--dictionary-size")
        size, rest = int(rest[i + 1]), rest[:i] + rest[i + 2 :]
    torch.save(shape_only_state(rest, size), out)
    print(f"wrote {out}: the shapes of {len(torch.load(out, mmap=True, weights_only=False)['model'])} tensors")


if __name__ == "__main__":
    main()
