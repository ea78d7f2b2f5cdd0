"""fairseq-train on a filesystem without hard links (gcsfuse, blobfuse, some SMB/NFS mounts).

Usage (under torchrun): python tests/support/probes/fairseq_no_hardlinks_probe.py <fairseq-train arguments>
``os.link`` fails with EPERM, as link(2) does there; each refused link prints "refused hard link
<target>", so a test sees that the save really went without one.
"""

import errno
import os
import sys


def main():
    def link(source, target, *args, **kwargs):
        print(f"refused hard link {target}", flush=True)
        raise OSError(errno.EPERM, os.strerror(errno.EPERM), target)

    os.link = link
    from fairseq_cli import train

    sys.argv = ["fairseq-train"] + sys.argv[1:]
    train.cli_main()


if __name__ == "__main__":
    main()
