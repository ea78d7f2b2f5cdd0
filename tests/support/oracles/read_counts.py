"""What the checkpoint tier reads of a file, counted on its own: every read of every file it opens through
``one_read.CountingReader`` (a zip checkpoint's pickle, each tensor's archive member), by offset and length."""

from collections import defaultdict
from pathlib import Path

import torch

from fairseq_moe_ext.checkpoint import one_read


def counted_reads(monkeypatch):
    """{path: [(offset, length) of every read]}, of every file the checkpoint tier opens through its reader."""
    reads, real = defaultdict(list), one_read.CountingReader

    class Recording(real):
        def __init__(self, path, on_read=None):
            super().__init__(path, on_read)
            self.reads = reads[str(path)]

    monkeypatch.setattr(one_read, "CountingReader", Recording)
    return reads


def assert_each_byte_read_once(reads, hf_dir: Path):
    """No byte of a shard read twice, and every tensor's bytes read (the reads cover the tensor data)."""
    for shard in sorted(hf_dir.glob("pytorch_model*.bin")):
        spans = sorted(reads[str(shard)])
        assert spans, f"{shard.name} never read"
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:])), f"{shard.name}: a byte read twice"
        tensors = torch.load(shard, weights_only=True, mmap=True)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}
        assert sum(storages.values()) <= sum(n for _, n in spans) <= shard.stat().st_size, shard.name
