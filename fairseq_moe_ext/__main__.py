"""``python -m fairseq_moe_ext --user-dir`` prints the directory to pass to ``--user-dir``."""

import argparse
import os
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fairseq_moe_ext")
    parser.add_argument("--user-dir", action="store_true", help="print the path for fairseq's --user-dir")
    args = parser.parse_args(argv)
    if not args.user_dir:
        parser.print_help()
        return 1
    print(os.path.dirname(os.path.abspath(__file__)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
