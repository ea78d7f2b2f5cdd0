"""Bad input, fine-tuning controls: --moe-freeze and --moe-balance-scope combinations that cannot work. The
same table-driven runner as tests/cli/test_bad_input.py (each case through the real command line: a non-zero
exit, one last line naming the problem and the fix, no file changed or added)."""

import pytest

from support.inputs.bad_input_makers import fresh_training
from support.launch.bad_input_runner import TRAIN, Case, check_case, fairseq_train

pytestmark = pytest.mark.slow

# fmt: off
CASES = [
    Case("freeze-every-part", fairseq_train, fresh_training("--moe-freeze", "router,experts,shared"), TRAIN,
         "--moe-freeze router,experts,shared freezes every parameter, so nothing would train",
         "leave at least one of router, experts, shared out"),
    Case("freeze-an-unknown-part", fairseq_train, fresh_training("--moe-freeze", "router,gate"), TRAIN,
         "--moe-freeze router,gate: unknown part 'gate'", "name any of router, experts, shared"),
    Case("global-batch-scope-without-a-balance-loss", fairseq_train,
         fresh_training("--moe-balance-scope", "global-batch", "--moe-gate-loss-wt", "0"), TRAIN,
         "--moe-balance-scope global-batch chooses which tokens the balance loss counts, but --moe-gate-loss-wt 0 "
         "turns that loss off", "give it a weight (e.g. --moe-gate-loss-wt 0.01) or drop --moe-balance-scope"),
    Case("global-batch-scope-with-a-frozen-router", fairseq_train,
         fresh_training("--moe-balance-scope", "global-batch", "--moe-freeze", "router"), TRAIN,
         "--moe-balance-scope global-batch shapes the balance loss, which --moe-freeze router leaves out of the loss",
         "drop --moe-balance-scope, or let the router train"),
]
# fmt: on


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_input_fails_in_one_line_naming_problem_and_fix_and_changes_no_file(case, started):
    check_case(case, started[case.id])
