"""fairseq-train whose json log records carry every digit of the losses (see full_precision_logs).

Usage (under torchrun, or plain): python tests/support/probes/fairseq_train_every_digit.py <fairseq-train arguments>
"""

import sys

from full_precision_logs import log_every_digit

if __name__ == "__main__":
    from fairseq_cli import train  # first: importing it sets up fairseq's log format

    log_every_digit()
    sys.argv = ["fairseq-train"] + sys.argv[1:]
    train.cli_main()
