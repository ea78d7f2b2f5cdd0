"""Copy one file out of the wheel in a directory: ``python wheel_member.py WHEEL_DIR MEMBER DEST_DIR``.

recipes/lib/venv.sh takes transformers' NLLB-MoE converter script out of the wheel tests/requirements-converter.txt
pins (a test-only oracle; nothing else of that wheel is installed)."""

import glob
import os
import sys
import zipfile


def main(wheel_dir: str, member: str, dest: str) -> int:
    wheels = glob.glob(os.path.join(wheel_dir, "*.whl"))
    if len(wheels) != 1:
        print(f"{wheel_dir}: expected one wheel, found {len(wheels)}: {member} not taken", file=sys.stderr)
        return 1
    os.makedirs(dest, exist_ok=True)
    with zipfile.ZipFile(wheels[0]) as wheel:
        data = wheel.read(member)
    with open(os.path.join(dest, os.path.basename(member)), "wb") as out:
        out.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
