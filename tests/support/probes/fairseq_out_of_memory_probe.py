"""fairseq-train whose worker RANK=1 runs out of device memory in the experts of its first MoE call.

Usage (under torchrun): python tests/support/probes/fairseq_out_of_memory_probe.py <fairseq-train arguments>
The experts raise torch.OutOfMemoryError with CUDA's message once, as a GPU that receives too many
rows does: after the MoE layer's first all-to-all, while the other worker waits for the second.
"""

import os
import sys

import torch


def main():
    if os.environ.get("RANK") == "1":
        from fairseq_moe_ext.moe.experts import BatchedExperts

        forward = BatchedExperts.forward

        def out_of_memory_once(self, *args, **kwargs):
            BatchedExperts.forward = forward
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 1; 79.10 GiB total "
                "capacity; 77.95 GiB already allocated)"
            )

        BatchedExperts.forward = out_of_memory_once
    from fairseq_cli import train

    sys.argv = ["fairseq-train"] + sys.argv[1:]
    train.cli_main()


if __name__ == "__main__":
    main()
