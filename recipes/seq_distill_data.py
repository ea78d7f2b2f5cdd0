"""Sequence-level distillation's data (Kim and Rush 2016): the teacher's beam output for every training source
sentence, binarised with the student's dictionaries as the student's training targets.

The training source side is cut into shards of ``--shard-lines`` sentences; each shard is binarised with the
dictionaries (as a "test" subset of its own), the teacher translates it with fairseq-generate (beam
``--beam``; in one process, or on ``--workers`` torchrun workers: sharded generation, each worker holding
its share of the teacher's experts when its set was saved by that many workers) and its hypotheses, in
sentence order and in the corpus's own tokens (sentencepiece pieces, no --remove-bpe), are written to
``shards/NNNNN.hyp`` (written whole, then renamed). A shard whose ``.hyp`` exists is never generated again, so
the step restarts where it stopped on a large corpus. Once every shard is done, the sources and the
teacher's outputs are binarised with the student's dictionaries (``--srcdict``/``--tgtdict``) beside the
original valid and test sets: OUT/bin, what the student trains on (``fairseq-train OUT/bin ...``).

  python recipes/seq_distill_data.py --tok WORK/data/tok --dicts WORK/data/bin --teacher WORK/moe/ckpt/checkpoint_best.pt \
      --out WORK/distillation/seq_data [--shard-lines 2000] [--beam 5] [--workers 2]
"""

import argparse
import glob
import os
import sys
import tempfile
import time
from pathlib import Path

from prune_by_dialect import BIN, USER_DIR, run
from score_translations import HYPOTHESIS, hypotheses


def cut(tok: Path, shard_lines: int, shards: Path) -> int:
    """The training pairs cut into shards (``NNNNN.src``/``.tgt``; kept when already cut this way, every output
    of another cut removed); their count."""
    sources = (tok / "train.src").read_text().splitlines()
    targets = (tok / "train.tgt").read_text().splitlines()
    count = -(-len(sources) // shard_lines)
    if (shards / ".cut").exists() and (shards / ".cut").read_text() == f"{len(sources)} {shard_lines}":
        return count
    shards.mkdir(parents=True, exist_ok=True)
    for stale in shards.glob("*.hyp"):  # outputs of another cut: their sentences are not these shards'
        stale.unlink()
    for s in range(count):
        for side, lines in (("src", sources), ("tgt", targets)):
            part = lines[s * shard_lines : (s + 1) * shard_lines]
            (shards / f"{s:05d}.{side}").write_text("".join(line + "\n" for line in part))
    (shards / ".cut").write_text(f"{len(sources)} {shard_lines}")
    return count


def generate_shard(shard: Path, dicts: Path, teacher: Path, beam: int, workers: int) -> list:
    """The teacher's hypotheses of one shard, in sentence order, in the corpus's tokens."""
    with tempfile.TemporaryDirectory(dir=shard.parent) as scratch:
        data, logs = Path(scratch) / "bin", Path(scratch) / "logs"
        run([BIN / "fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt", "--testpref", shard,
             "--srcdict", dicts / "dict.src.txt", "--tgtdict", dicts / "dict.tgt.txt", "--destdir", data,
             "--workers", 1], Path(scratch) / "preprocess.log")  # fmt: skip
        command = [BIN / "fairseq-generate", data, "--user-dir", USER_DIR, "--path", teacher, "--cpu",
                   "--gen-subset", "test", "--beam", beam, "--batch-size", 64, "--required-batch-size-multiple", 1,
                   "--num-workers", 0]  # fmt: skip
        log = Path(scratch) / "generate.out"
        if workers > 1:  # each worker prints its own sentences into its own log
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", workers,
                       "--log-dir", logs, "--redirects", 1, *command, "--distributed-world-size", workers]  # fmt: skip
        run(command, log)
        text = log.read_text() + "".join(
            Path(p).read_text() for p in glob.glob(f"{logs}/**/stdout.log", recursive=True)
        )
    expected = len(Path(f"{shard}.src").read_text().splitlines())
    ids = {int(m.group(1)) for m in map(HYPOTHESIS.match, text.splitlines()) if m}
    if ids != set(range(expected)):
        sys.exit(f"{shard}: hypotheses of {len(ids)} of its {expected} sentences")
    return hypotheses(text)


def binarise(tok: Path, dicts: Path, shards: Path, count: int, out: Path) -> Path:
    """The sources and the teacher's outputs as the training set, the original valid and test sets beside them."""
    train = out / "tok" / "train"
    train.parent.mkdir(parents=True, exist_ok=True)
    for side, suffix in (("src", "src"), ("tgt", "hyp")):
        with open(f"{train}.{side}", "w") as f:
            for s in range(count):
                f.write((shards / f"{s:05d}.{suffix}").read_text())
    data = out / "bin"
    run([BIN / "fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt", "--trainpref", train,
         "--validpref", tok / "valid", "--testpref", tok / "test", "--srcdict", dicts / "dict.src.txt",
         "--tgtdict", dicts / "dict.tgt.txt", "--destdir", data, "--workers", 1], out / "preprocess.log")  # fmt: skip
    (data / ".done").write_text(f"{count}")
    return data


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tok", type=Path, required=True, help="the tokenized corpus: train/valid/test.{src,tgt}")
    parser.add_argument("--dicts", type=Path, required=True, help="a directory with dict.src.txt and dict.tgt.txt")
    parser.add_argument("--teacher", type=Path, required=True, help="the teacher's checkpoint (a set or a file)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shard-lines", type=int, default=2000)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--workers", type=int, default=1, help="torchrun workers for generation (1: one process)")
    args = parser.parse_args(argv)
    shards = args.out / "shards"
    count = cut(args.tok, args.shard_lines, shards)
    started, made = time.time(), 0
    for s in range(count):
        hyp = shards / f"{s:05d}.hyp"
        if hyp.exists():
            continue  # done by an earlier run: never generated again
        found = generate_shard(shards / f"{s:05d}", args.dicts, args.teacher, args.beam, args.workers)
        hyp.with_suffix(".hyp.tmp").write_text("".join(line + "\n" for line in found))
        os.replace(hyp.with_suffix(".hyp.tmp"), hyp)
        made += len(found)
        print(f"shard {s + 1}/{count}: {len(found)} sentences", flush=True)
    if made:
        rate = made / max(time.time() - started, 1e-9)
        (args.out / "generation_rate.txt").write_text(f"{rate:.2f} sentences/s over {made} sentences\n")
    signature = f"{count}"
    if not ((args.out / "bin" / ".done").exists() and (args.out / "bin" / ".done").read_text() == signature):
        binarise(args.tok, args.dicts, shards, count, args.out)
    print(f"{args.out / 'bin'}: the teacher's outputs of {count} shard(s) as the training targets")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
