"""The text files a flag names, read by one reader.

A file that cannot be read, is not UTF-8 text, or does not hold one line per item of what it describes is
refused in one line naming the flag, the file and the fix (an ``MoEOptionError``, or the caller's refusal
type), never a ``UnicodeDecodeError`` naming neither. Read whole, as bytes, then decoded: the line of a
byte that is not UTF-8 is counted, and a UTF-8 byte-order mark (what Windows editors write first) is
dropped instead of becoming part of the first line. Users: ``--moe-routing-stats-groups``
(fairseq_integration/routing_stats.py), the checkpoint tool's ``--langs``, ``--dictionary`` and ``--stats``.
"""

from typing import Callable, List

from .refusal import MoEOptionError, MoERefusal

Refuse = Callable[[str], MoERefusal]
BYTE_ORDER_MARK = "\ufeff"


def read_text(path: str, flag: str, holds: str, refuse: Refuse = MoEOptionError) -> str:
    """The text of ``path``, decoded as UTF-8; ``holds`` says what the file should hold ("one key per line
    of the subset"), the fix of every refusal."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise refuse(f"{flag} {path}: cannot read it ({e.strerror or e}); give a file holding {holds}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise refuse(
            f"{flag} {path} is not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}): save it as UTF-8 "
            f"(iconv -f latin1 -t utf-8 converts a Latin-1 file), a file holding {holds}"
        ) from None
    return text[1:] if text.startswith(BYTE_ORDER_MARK) else text


def read_lines(path: str, flag: str, holds: str, refuse: Refuse = MoEOptionError) -> List[str]:
    """The lines of ``path`` without their line ends (``\\n`` or ``\\r\\n``); the newline that ends the
    last line starts no line of its own."""
    lines = read_text(path, flag, holds, refuse).split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def check_line_count(
    lines: List[str], expected: int, path: str, flag: str, describes: str, holds: str, refuse: Refuse = MoEOptionError
) -> None:
    """One line of ``path`` per item of what it ``describes`` ("the subset valid's sentences"), ``expected``
    of them: a longer file is as wrong as a shorter one (each line would label another item)."""
    if len(lines) != expected:
        raise refuse(f"{flag} {path} has {len(lines)} lines, but {describes} number {expected}: give {holds}")
