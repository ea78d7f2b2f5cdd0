"""Score fairseq-generate output with sacrebleu against the raw (untokenized) references.

fairseq-generate prints hypotheses in the order batches finish; ``H-<id>`` gives the line of the
test set. With ``--remove-bpe sentencepiece`` (or ``--post-process``) the hypothesis text is already
detokenized, so it is compared with the original reference text, as sacrebleu intends. With
``--domains`` (one label per test line) BLEU is also reported per domain.

  python recipes/score_translations.py gen.out --ref test.tgt [--domains test.domain] \
      --hyp-out hyp.txt --json-out bleu.json
"""

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import sacrebleu

HYPOTHESIS = re.compile(r"^H-(\d+)\t\S+\t(.*)$")


def hypotheses(generate_output: str) -> list:
    by_id = {}
    for line in generate_output.splitlines():
        match = HYPOTHESIS.match(line)
        if match:
            by_id[int(match.group(1))] = match.group(2)
    return [by_id.get(i, "") for i in range(max(by_id) + 1)] if by_id else []


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("generate_output", type=Path)
    parser.add_argument("--ref", type=Path, required=True, help="raw reference text, one line per test sentence")
    parser.add_argument("--domains", type=Path, help="a domain label per test line: also score each domain")
    parser.add_argument("--hyp-out", type=Path, help="write the detokenized hypotheses in test-set order")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--name", default="", help="label for the printed line")
    args = parser.parse_args(argv)

    refs = args.ref.read_text().splitlines()
    hyps = hypotheses(args.generate_output.read_text())
    if len(hyps) != len(refs):
        sys.exit(
            f"{args.generate_output}: {len(hyps)} hypotheses for {len(refs)} references "
            "(did fairseq-generate finish, on the same --gen-subset?)"
        )
    if args.hyp_out:
        args.hyp_out.write_text("".join(h + "\n" for h in hyps))

    metric = sacrebleu.BLEU()
    bleu = metric.corpus_score(hyps, [refs])
    result = {
        "bleu": round(bleu.score, 2),
        "sacrebleu": str(bleu),
        "signature": str(metric.get_signature()),
        "sentences": len(refs),
    }
    if args.domains:
        labels = args.domains.read_text().splitlines()
        grouped = defaultdict(lambda: ([], []))
        for label, hyp, ref in zip(labels, hyps, refs):
            grouped[label][0].append(hyp)
            grouped[label][1].append(ref)
        result["by_domain"] = {
            label: round(sacrebleu.corpus_bleu(h, [r]).score, 2) for label, (h, r) in grouped.items()
        }
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    per_domain = "  ".join(f"{d} {b:.1f}" for d, b in result.get("by_domain", {}).items())
    print(f"{args.name + ': ' if args.name else ''}{bleu}" + (f"\n    by domain: {per_domain}" if per_domain else ""))


if __name__ == "__main__":
    main()
