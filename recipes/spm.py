"""sentencepiece from the command line (the pip package ships no spm_train/spm_encode binaries).

python recipes/spm.py train --input train.src --prefix spm/src --vocab-size 256
python recipes/spm.py encode --model spm/src.model < in.txt > out.txt
python recipes/spm.py decode --model spm/src.model < pieces.txt > text.txt
"""

import argparse
import sys

import sentencepiece as spm


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train")
    train.add_argument("--input", required=True, help="comma-separated text files")
    train.add_argument("--prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--model-type", default="unigram", choices=["unigram", "bpe", "char", "word"])
    train.add_argument("--character-coverage", type=float, default=1.0)
    train.add_argument("--max-sentences", type=int, default=0, help="sample at most this many lines (0 = all)")
    train.add_argument("--seed", type=int, default=1)
    train.add_argument(
        "--keep-whitespace",
        action="store_true",
        help="for code: no whitespace normalisation, and runs of spaces may become pieces",
    )
    for name in ("encode", "decode"):
        sub.add_parser(name).add_argument("--model", required=True)
    args = parser.parse_args(argv)

    if args.command == "train":
        spm.set_random_generator_seed(args.seed)  # sampling and EM are otherwise seeded from the clock
        spm.SentencePieceTrainer.train(
            input=args.input,
            model_prefix=args.prefix,
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            character_coverage=args.character_coverage,
            # A small corpus may support fewer pieces than asked for: take what it supports.
            hard_vocab_limit=False,
            input_sentence_size=args.max_sentences,
            shuffle_input_sentence=args.max_sentences > 0,
            # fairseq-preprocess builds its own dictionary; keep sentencepiece's specials out of the text.
            bos_id=-1,
            eos_id=-1,
            unk_id=0,
            minloglevel=2,
            num_threads=1,
            **(
                dict(
                    normalization_rule_name="identity",
                    remove_extra_whitespaces=False,
                    allow_whitespace_only_pieces=True,
                )
                if args.keep_whitespace
                else {}
            ),
        )
        return
    model = spm.SentencePieceProcessor(model_file=args.model)
    for line in sys.stdin:
        line = line.rstrip("\n")
        if args.command == "encode":
            print(" ".join(model.encode(line, out_type=str)))
        else:
            print(model.decode(line.split()))


if __name__ == "__main__":
    main()
