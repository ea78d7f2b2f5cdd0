#!/usr/bin/env python
"""The main job's training wall time, MoE against the compute-matched dense model, for this checkout's plugin
and another's side by side: ``recipes/main.sh`` (DENSE=0: the MoE and ``dense_matched``, whose FFN spends
TOPK x FFN_DIM per token, about 115% of the MoE's FLOPs) once per plugin, the other through MOE_USER_DIR.

    python benchmarks/main_job_wall.py --baseline-user-dir ../base/fairseq_moe_ext   # about 2 x 9 min on 2 cores

Each run trains both models on 2 gloo workers with every flag of the main job; the figure is fairseq's
``wall`` of the last train record (seconds since training started), for each model, and MoE / dense within
a run (the two trained back to back, so they saw the same machine). The load average before and after each
run is printed beside it: on a shared machine the ratio, not the seconds, is what compares.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "recipes"))  # what benchmarks share with tests and recipes

sys.path.insert(0, str(HERE))
from fairseq_logs import json_records  # noqa: E402
from side_by_side import Loads, run_folder, stamp  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-user-dir", help="another checkout's plugin (its fairseq_moe_ext folder) to run too")
    p.add_argument("--repeats", type=int, default=1, help="runs per plugin, alternating (default 1)")
    p.add_argument("--keep", help="keep the runs in this folder instead of a temporary one")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run of main.sh")
    return p.parse_args(argv)


def training_wall(log: Path) -> float:
    records = json_records(log.read_text(), "train")
    if not records:
        sys.exit(f"main_job_wall.py: no train record in {log}")
    # an epoch's record names fairseq's wall meter (seconds since training started) train_wall
    return float(records[-1]["train_wall"])


def run_main_job(work: Path, user_dir, timeout, loads: Loads) -> dict:
    env = dict(os.environ, WORK=str(work), DENSE="0")
    if user_dir:
        env["MOE_USER_DIR"] = str(Path(user_dir).resolve())
    log = work.parent / f"{work.name}.log"
    with open(log, "w") as out, loads.run(work.name):
        code = subprocess.call(["bash", str(ROOT / "recipes" / "main.sh")], cwd=ROOT, env=env, stdout=out,
                               stderr=subprocess.STDOUT, timeout=timeout)  # fmt: skip
    if code != 0:
        sys.exit(f"main_job_wall.py: recipes/main.sh exited {code}; see {log}")
    walls = {model: training_wall(work / model / "train.log") for model in ("moe", "dense_matched")}
    return dict(walls, load=loads.range(work.name))


def main(argv=None):
    args = parse_args(argv)
    root = run_folder(args.keep, "main_job_wall_")
    print(f"# main job training wall time, {stamp()}, runs in {root}")
    arms = [("this checkout", None)] + ([("baseline", args.baseline_user_dir)] if args.baseline_user_dir else [])
    rows, loads = [], Loads()
    for rep in range(args.repeats):
        for name, user_dir in arms if rep % 2 == 0 else arms[::-1]:  # alternating: drifts hit both alike
            found = run_main_job(root / f"{name.replace(' ', '_')}-{rep}", user_dir, args.timeout, loads)
            rows.append((name, found))
            print(json.dumps({"plugin": name, **found}), flush=True)
    print(f"\n{'plugin':<16}{'moe s':>8}{'dense_matched s':>17}{'moe / dense':>13}{'load':>20}")
    for name, r in rows:
        print(
            f"{name:<16}{r['moe']:>8.0f}{r['dense_matched']:>17.0f}{r['moe'] / r['dense_matched']:>13.3f}{r['load']:>20}"
        )
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
