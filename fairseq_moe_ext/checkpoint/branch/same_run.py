"""The files of one moe/nllb-branch save: every rank file (and the shared file) records the update it was
saved at and the run's options, and a file of another update or another run is refused in one line.

Branch sets have no manifest, and key names and shapes alone let ``-rank-2.pt`` of another save (update
250000 among 300000) or of another seed pass as expert 2. Each file is compared with rank 0's: its update
count, the options that shape the model or what it computes (``--arch``, every ``--encoder-*`` /
``--decoder-*`` / ``--moe-*`` option, the activation and embedding sharing) and ``--seed``; paths and the
per-worker options (``--distributed-rank``, ``--device-id``) may differ.
"""

from typing import Dict, Optional

from ...common.config_value import config_value
from ..errors import CheckpointSetError

PREFIXES = ("moe_", "encoder_", "decoder_")
NAMED = ("arch", "_name", "activation_fn", "share_all_embeddings", "share_decoder_input_output_embed")


def saved_update(state: Dict) -> Optional[int]:
    history = state.get("optimizer_history") or [{}]
    value = (history[-1] or {}).get("num_updates") if isinstance(history, list) else None
    return int(value) if isinstance(value, int) else None


def run_options(state: Dict) -> Optional[Dict[str, object]]:
    """The options that must agree, or None where the file records none (a shared file may not)."""
    cfg = state.get("cfg") if isinstance(state.get("cfg"), dict) else None
    model = cfg.get("model") if cfg else None
    model = state.get("args") if model is None else model
    if model is None:
        return None
    fields = model if isinstance(model, dict) else vars(model)
    options = {
        name: value
        for name, value in fields.items()
        if (name.startswith(PREFIXES) or name in NAMED) and not name.endswith(("_path", "_dir"))
    }
    seed = config_value(cfg.get("common"), "seed") if cfg and cfg.get("common") is not None else None
    options["seed"] = seed if seed is not None else config_value(state.get("args"), "seed")
    return options


class SameRun:
    """Rank 0's update and options; ``check`` refuses a file whose differ."""

    def __init__(self, first: Dict, first_path: str):
        self.path, self.update, self.options = first_path, saved_update(first), run_options(first)

    def check(self, state: Dict, path: str) -> None:
        update = saved_update(state)
        if update is not None and self.update is not None and update != self.update:
            raise CheckpointSetError(
                f"{path} was saved at update {update} and {self.path} at update {self.update}: files of different "
                f"saves; import the -shared.pt and -rank-N.pt files of one save (nothing was written)"
            )
        options = run_options(state)
        if options is None or self.options is None:
            return
        for name in sorted(set(options) | set(self.options)):
            if name != "_name" and options.get(name) != self.options.get(name):
                flag = "--" + name.replace("_", "-")
                raise CheckpointSetError(
                    f"{path} was trained with {flag} {options.get(name)!r} and {self.path} with "
                    f"{self.options.get(name)!r}: files of different runs; import the -shared.pt and -rank-N.pt "
                    f"files of one run (nothing was written)"
                )
