#!/usr/bin/env python
"""Whether a folder of wheels is a whole, installable set for the lent GPU machine.

    python benchmarks/device/wheelset.py .whl          # exit 1 with one line per problem

A set is whole when every wheel installs on the machine's interpreter (CPython 3.12, x86-64,
manylinux up to glibc 2.28: the tags the device tool's README downloads for), each distribution
comes in one version (pip stops the whole install on two), it and the tree that travels with it
stay under the 64 MiB a call may carry, and every requirement of a carried wheel (its Requires-Dist,
markers evaluated for that interpreter, extras left out) is carried at a version it accepts or is on
the machine already (device_packages.txt). A requirement that is neither is accepted only when no
file of the wheel that declares it imports it (fairseq declares cffi and never imports it), and is
then listed as such. Needs ``packaging`` (there on the machine and here).
"""

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, Iterable, List, NamedTuple, Optional, Set

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEVICE_PACKAGES = HERE / "device_packages.txt"
CARRIED = HERE / "wheels.txt"
TRAVEL_LIMIT = 64 * 2**20  # all that one device call carries: the tree and the carried paths
PYTHON_TAGS = {"cp312", "py312", "py3"}  # a tag like py2.py3 lists alternatives
ABI_TAGS = {"cp312", "abi3", "none"}
GLIBC_LIMIT = (2, 28)  # the newest manylinux the device tool's README downloads for
LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
# The machine's interpreter, for Requires-Dist markers (python 3.12.3 seen there).
# fmt: off
DEVICE_MARKERS = dict(
    default_environment(), python_version="3.12", python_full_version="3.12.3", implementation_name="cpython",
    platform_python_implementation="CPython", sys_platform="linux", platform_system="Linux",
    platform_machine="x86_64", os_name="posix", implementation_version="3.12.3",
)
# fmt: on


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class Wheel(NamedTuple):
    path: Path
    name: str  # normalized
    version: str
    python: str
    abi: str
    platform: str

    @property
    def size(self) -> int:
        return self.path.stat().st_size


def parse_wheel(path: Path) -> Wheel:
    parts = path.name[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        raise ValueError(f"{path.name}: not a wheel file name (name-version[-build]-python-abi-platform.whl)")
    return Wheel(path, normalize(parts[0]), parts[1], parts[-3], parts[-2], parts[-1])


def read_names(path: Path) -> List[str]:
    """The first word of each line that is not blank or a comment."""
    lines = (line.split("#", 1)[0].split() for line in path.read_text().splitlines())
    return [words[0] for words in lines if words]


def device_packages(path: Path = DEVICE_PACKAGES) -> Set[str]:
    return {normalize(name) for name in read_names(path)}


def carried_pins(path: Path = CARRIED) -> Dict[str, str]:
    """``{normalized name: version}`` of wheels.txt."""
    pins = {}
    for spec in read_names(path):
        name, _, version = spec.partition("==")
        pins[normalize(name)] = version
    return pins


def tag_problem(wheel: Wheel) -> Optional[str]:
    pythons = set(wheel.python.split("."))
    stable_abi = wheel.abi == "abi3" and any(re.fullmatch(r"cp3(\d+)", p) and int(p[3:]) <= 12 for p in pythons)
    if not pythons & PYTHON_TAGS and not stable_abi:
        return f"{wheel.path.name}: built for {wheel.python}, not CPython 3.12: download it with --python-version 3.12"
    if wheel.abi not in ABI_TAGS:
        return f"{wheel.path.name}: ABI {wheel.abi} is not CPython 3.12's: download it with --python-version 3.12"
    if wheel.platform == "any":
        return None
    for platform in wheel.platform.split("."):
        if platform.endswith("_x86_64"):
            stem = platform[: -len("_x86_64")]
            glibc = LEGACY_MANYLINUX.get(stem)
            match = re.fullmatch(r"manylinux_(\d+)_(\d+)", stem)
            if match:
                glibc = (int(match.group(1)), int(match.group(2)))
            if glibc is not None and glibc <= GLIBC_LIMIT:
                return None
    return (
        f"{wheel.path.name}: platform {wheel.platform} is not manylinux x86-64 up to glibc "
        f"{GLIBC_LIMIT[0]}.{GLIBC_LIMIT[1]}: download it with --platform manylinux_2_28_x86_64"
    )


def metadata_requirements(wheel: Wheel) -> List[Requirement]:
    """The Requires-Dist of ``wheel`` that apply on the machine (markers evaluated, no extras)."""
    with zipfile.ZipFile(wheel.path) as archive:
        names = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        if len(names) != 1:
            raise ValueError(f"{wheel.path.name}: expected one top-level *.dist-info/METADATA, found {len(names)}")
        text = archive.read(names[0]).decode("utf-8", errors="replace")
    requirements = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.split(":", 1)[1].strip())
            if requirement.marker is None or requirement.marker.evaluate(dict(DEVICE_MARKERS, extra="")):
                requirements.append(requirement)
    return requirements


def imports_module(wheel: Wheel, module: str) -> bool:
    """Whether any Python file in ``wheel`` has an ``import module`` or ``from module`` statement."""
    pattern = re.compile(rf"^\s*(?:import|from)\s+{re.escape(module)}\b", re.MULTILINE)
    with zipfile.ZipFile(wheel.path) as archive:
        for name in archive.namelist():
            if name.endswith(".py") and pattern.search(archive.read(name).decode("utf-8", errors="replace")):
                return True
    return False


def travelling_tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the files a device call sends besides the carried paths: tracked files and untracked
    ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sum((root / name).stat().st_size for name in listed.split("\0") if name and (root / name).is_file())


def check_set(wheels: Iterable[Wheel], on_device: Set[str], tree_bytes: int = 0):
    """``(problems, notes)``: one line each; the set is whole when ``problems`` is empty."""
    wheels = sorted(wheels, key=lambda w: w.name)
    problems, notes = [], []
    if not wheels:
        return ["no wheels: run benchmarks/device/prepare_wheels.sh"], notes
    by_name: Dict[str, Wheel] = {}
    for wheel in wheels:
        if wheel.name in by_name:
            problems.append(
                f"two versions of {wheel.name}: {by_name[wheel.name].path.name} and {wheel.path.name} "
                f"(pip stops the whole install): delete one"
            )
        by_name[wheel.name] = wheel
        problem = tag_problem(wheel)
        if problem:
            problems.append(problem)
    total = sum(w.size for w in wheels)
    if total + tree_bytes > TRAVEL_LIMIT:
        problems.append(
            f"the wheels ({total / 2**20:.1f} MiB) and the tree ({tree_bytes / 2**20:.1f} MiB) exceed the "
            f"{TRAVEL_LIMIT // 2**20} MiB a device call carries: carry fewer wheels"
        )
    for wheel in wheels:
        for requirement in metadata_requirements(wheel):
            name = normalize(requirement.name)
            if name in by_name:
                have = by_name[name].version
                if requirement.specifier and not requirement.specifier.contains(Version(have), prereleases=True):
                    problems.append(f"{wheel.name} needs {requirement}, but the set carries {name} {have}")
            elif name in on_device:
                continue
            elif imports_module(wheel, name.replace("-", "_")):
                problems.append(
                    f"{wheel.name} needs {requirement} and imports it, but neither the set nor the "
                    f"machine has it: add it to benchmarks/device/wheels.txt"
                )
            else:
                notes.append(f"{wheel.name} declares {requirement}, which no file of it imports: not carried")
    return problems, notes


def pins_not_installed(pins: Dict[str, str]) -> List[str]:
    """The pins whose version differs from (or is missing in) this Python's installed distributions."""
    from importlib.metadata import PackageNotFoundError, version

    off = []
    for name, pinned in pins.items():
        try:
            have = version(name)
        except PackageNotFoundError:
            have = None
        if have != pinned:
            off.append(f"{name}=={pinned} (installed here: {have})")
    return off


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", nargs="?", default=str(ROOT / ".whl"), help="the wheels (default .whl/)")
    parser.add_argument("--device-packages", default=str(DEVICE_PACKAGES))
    parser.add_argument("--no-tree", action="store_true", help="leave the travelling tree out of the size")
    parser.add_argument(
        "--pins-installed",
        action="store_true",
        help="only check that wheels.txt's versions are the ones this Python has installed",
    )
    args = parser.parse_args(argv)
    if args.pins_installed:
        off = pins_not_installed(carried_pins())
        print(
            "  the pins of wheels.txt are the versions installed here (what the tests run with)"
            if not off
            else f"wheelset: pinned versions differ from this Python's: {'; '.join(off)}: update wheels.txt"
        )
        return 1 if off else 0
    wheels = [parse_wheel(p) for p in sorted(Path(args.folder).glob("*.whl"))]
    tree = 0 if args.no_tree else travelling_tree_bytes()
    problems, notes = check_set(wheels, device_packages(Path(args.device_packages)), tree)
    for wheel in sorted(wheels, key=lambda w: w.name):
        print(f"{wheel.size / 2**20:8.2f} MiB  {wheel.path.name}")
    total = sum(w.size for w in wheels)
    print(
        f"{total / 2**20:8.2f} MiB  in {len(wheels)} wheels; with the tree that travels "
        f"({tree / 2**20:.2f} MiB): {(total + tree) / 2**20:.2f} MiB of {TRAVEL_LIMIT // 2**20} MiB"
    )
    for note in notes:
        print(f"note: {note}")
    for problem in problems:
        print(f"wheelset: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
