"""``python -m fairseq_moe_ext --user-dir`` prints the directory to pass to ``--user-dir``;
``python -m fairseq_moe_ext plan <fairseq-train arguments> --world-size W [--device-memory 80GiB]``
prints what each worker holds, per backend and expert-parallel size (training/plan_cli.py)."""

import argparse
import os
import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:
        from .training.plan_cli import main as plan

        return plan(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m fairseq_moe_ext",
        epilog="python -m fairseq_moe_ext plan <fairseq-train arguments> --world-size W [--device-memory 80GiB]: "
        "per-worker memory for every backend and expert-parallel size",
    )
    parser.add_argument("--user-dir", action="store_true", help="print the path for fairseq's --user-dir")
    args = parser.parse_args(argv)
    if not args.user_dir:
        parser.print_help()
        return 1
    print(os.path.dirname(os.path.abspath(__file__)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
