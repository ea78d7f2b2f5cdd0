"""The wheels carried to the lent GPU machine (benchmarks/device/): a set is refused unless it installs
there whole, and the machine's package list is what the dry run of the GPU one-shot is held to."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from support.launch.paths import REPO_ROOT as ROOT

sys.path.insert(0, str(ROOT / "benchmarks" / "device"))
import wheelset  # noqa: E402


def make_wheel(folder: Path, name: str, version: str, tags="py3-none-any", requires=(), sources=None) -> Path:
    path = folder / f"{name.replace('-', '_')}-{version}-{tags}.whl"
    metadata = [f"Name: {name}", f"Version: {version}"] + [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", "\n".join(metadata) + "\n")
        for file, text in (sources or {f"{name.replace('-', '_')}/__init__.py": ""}).items():
            archive.writestr(file, text)
    return path


def check(folder, on_device=("numpy",), tree_bytes=0):
    wheels = [wheelset.parse_wheel(p) for p in sorted(folder.glob("*.whl"))]
    return wheelset.check_set(wheels, set(on_device), tree_bytes)


def test_a_set_with_two_versions_of_one_package_is_refused_naming_both_files(tmp_path):
    make_wheel(tmp_path, "omegaconf", "2.3.0")
    make_wheel(tmp_path, "omegaconf", "2.3.1")
    problems, _ = check(tmp_path)
    assert len(problems) == 1 and "two versions of omegaconf" in problems[0]
    assert "omegaconf-2.3.0-py3-none-any.whl" in problems[0] and "omegaconf-2.3.1-py3-none-any.whl" in problems[0]


@pytest.mark.parametrize(
    "tags, ok",
    [
        ("cp312-cp312-manylinux_2_28_x86_64", True),
        ("cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64", True),
        ("cp38-abi3-manylinux_2_17_x86_64", True),
        ("py2.py3-none-any", True),
        ("cp311-cp311-manylinux_2_28_x86_64", False),  # another interpreter
        ("cp312-cp312-manylinux_2_34_x86_64", False),  # a newer glibc than the downloads assume
        ("cp312-cp312-manylinux_2_28_aarch64", False),
        ("cp312-cp312-macosx_11_0_arm64", False),
    ],
)
def test_only_wheels_cpython_312_on_x86_64_manylinux_up_to_glibc_2_28_installs_are_accepted(tmp_path, tags, ok):
    make_wheel(tmp_path, "bitarray", "3.12.3", tags=tags)
    problems, _ = check(tmp_path)
    assert (problems == []) == ok, problems


def test_a_requirement_missing_on_the_machine_is_refused_only_if_the_wheel_imports_it(tmp_path):
    make_wheel(
        tmp_path,
        "ve-fairseq",
        "0.12.3",
        requires=["cffi", "numpy>=1.21", "regex"],
        sources={"fairseq/__init__.py": "import numpy\n", "fairseq/tok.py": "def f():\n    import regex\n"},
    )
    problems, notes = check(tmp_path)
    assert problems == [
        "ve-fairseq needs regex and imports it, but neither the set nor the machine has it: "
        "add it to benchmarks/device/wheels.txt"
    ]
    assert notes == ["ve-fairseq declares cffi, which no file of it imports: not carried"]
    assert check(tmp_path, on_device=("numpy", "regex"))[0] == []


def test_a_carried_requirement_at_a_version_its_dependent_excludes_is_refused(tmp_path):
    make_wheel(tmp_path, "hydra-core", "1.3.8", requires=["omegaconf<2.4,>=2.2", "antlr4-python3-runtime==4.9.*"])
    make_wheel(tmp_path, "omegaconf", "2.4.0")
    make_wheel(tmp_path, "antlr4-python3-runtime", "4.9.3")
    problems, _ = check(tmp_path)
    assert problems == ["hydra-core needs omegaconf<2.4,>=2.2, but the set carries omegaconf 2.4.0"]


def test_requirements_are_read_for_the_machines_python_3_12_without_extras(tmp_path):
    make_wheel(
        tmp_path,
        "hydra-core",
        "1.3.8",
        requires=[
            'importlib-resources; python_version < "3.9"',
            'pytest; extra == "dev"',
            'tomli; sys_platform == "win32"',
        ],
    )
    assert check(tmp_path) == ([], [])


def test_the_size_limit_counts_the_tree_that_travels_with_the_wheels(tmp_path):
    make_wheel(tmp_path, "omegaconf", "2.3.1")
    assert check(tmp_path, tree_bytes=wheelset.TRAVEL_LIMIT // 2)[0] == []
    problems, _ = check(tmp_path, tree_bytes=wheelset.TRAVEL_LIMIT)
    assert len(problems) == 1 and "exceed the 64 MiB" in problems[0]


def test_the_carried_pins_are_the_versions_the_test_suite_runs_with():
    assert wheelset.pins_not_installed(wheelset.carried_pins()) == []
    assert set(wheelset.carried_pins()) == {
        "ve-fairseq",
        "hydra-core",
        "omegaconf",
        "bitarray",
        "antlr4-python3-runtime",
    }
    assert not set(wheelset.carried_pins()) & wheelset.device_packages(), "carried what the machine has"


def test_under_the_machines_package_list_only_listed_distributions_import(tmp_path):
    refused_log = tmp_path / "refused.txt"
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT / "benchmarks" / "device" / "device_site"),
        DEVICE_SITE_LOG=str(refused_log),
        DEVICE_SITE_MISSING="pytest",
    )
    code = (
        "import importlib\n"
        "for name in ('cffi', 'pytest', 'numpy', 'omegaconf'):\n"
        "    try:\n        importlib.import_module(name); print(name, 'ok')\n"
        "    except ModuleNotFoundError as e:\n        print(name, 'refused')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.split("\n")[:4] == ["cffi refused", "pytest refused", "numpy ok", "omegaconf ok"], done.stderr
    assert refused_log.read_text().splitlines() == ["cffi (cffi)", "pytest (pytest)"]


def test_the_wheel_script_parses_and_says_what_it_proves():
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks/device/prepare_wheels.sh")]).returncode == 0
    usage = subprocess.run(
        ["bash", str(ROOT / "benchmarks/device/prepare_wheels.sh"), "--help"], capture_output=True, text=True
    )
    assert usage.returncode == 0 and "--no-index --no-deps --target" in usage.stdout and "3.12" in usage.stdout
