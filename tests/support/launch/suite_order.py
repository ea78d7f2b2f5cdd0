"""The order in which the suite hands tests to its two pytest-xdist workers (tests/conftest.py).

The workers take work in collection order, so a long test collected last would decide the wall time
alone on one worker while the other idles: the longest slow tests and module groups go first.
"""

# Node id fragments ("file::test name prefix", or a file for a module group), longest first: the
# slowest of the whole suite's --durations 25 (6c02879, 7 Dec 2026, tests/run.sh on 2 workers) and of
# its module groups, each on one worker since 08ecd64 (set-up on 2 workers, 7 Dec 2026:
# test_inference_dtype_cli's fixtures 52 s, test_memory_plan's one launch 27 s, test_fully_sharded_cli's 18 s).
# tests/repo/test_suite_order.py fails when a fragment stops naming a test.
# fmt: off
LONGEST_FIRST = (
    "test_fault_injection.py::test_eleven_seeded_sigkills",
    "test_recipes.py::test_distillation_tiny_mode",
    "test_gpu_scripts.py::test_the_cpu_dry_run",
    "test_gpu_scripts.py::test_the_dry_runs_verdicts_fail_on_a_planted",
    "test_recipes.py::test_expert_pruning_tiny_mode",
    "test_recipes.py::test_nllb_moe_dry_run",
    "test_inference_dtype_cli.py",
    "test_combination_matrix.py",
    "test_backend_precision_resume.py",
    "test_backend_precision_resume_cli.py",
    "test_recipes.py::test_python_stdlib_lm_quick_mode",
    "test_recipes.py::test_main_job_tiny_mode",
    "test_memory_plan.py",
    "test_fully_sharded_cli.py",
    "test_nccl_timeouts.py::test_other_workers_wait_for_rank_0",
    "test_warm_cli.py::test_an_emulated_two_worker_torchrun",
    "test_fully_sharded_precision.py::test_fully_sharded_bf16_fp16_and_amp_steps",
    "test_recipes.py::test_wmt16_dry_run",
    "test_fairseq_expert_parallel.py::test_a_step_on_four_workers_with_replicated_experts",
    "test_multiworker_training_cli.py::test_eval_lm_scores",
    "test_fully_sharded_step.py::test_a_fully_sharded_step_equals_one_process",
    "test_recipes.py::test_iwslt14_dry_run",
    "test_expert_replicas_cli.py::test_four_workers_with_two_experts",
    "test_recipes.py::test_wikitext103_dry_run",
    "test_warm_cli.py::test_a_forked_fairseq_train_refuses",
    "test_fault_injection.py::test_heartbeat_timeout_ends_a_job",
    "test_multiworker_cli.py",
    "test_multiworker_sets_cli.py",
    "test_distillation_cli.py",
)
# fmt: on


def longest_first_rank(nodeid: str) -> int:
    """Where a test goes among the longest (0 first); every other test ranks after them all."""
    return next((i for i, part in enumerate(LONGEST_FIRST) if part in nodeid), len(LONGEST_FIRST))


def hands_out_by_group(config) -> bool:
    """Whether tests are handed out by ``xdist_group`` (``--dist loadgroup``): xdist's workers read "no"
    for --dist and carry its own ``loadgroup`` value instead, which a run without xdist lacks."""
    return config.getoption("dist", default="no") == "loadgroup" or bool(config.getoption("loadgroup", default=False))
