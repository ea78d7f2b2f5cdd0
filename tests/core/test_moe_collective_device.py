"""Every collective the plugin issues hands its group tensors on a device the group serves.

On GPUs fairseq initialises plain ``nccl``, which serves CUDA tensors only; a CPU tensor fails with
"No backend type associated with device type cpu". A CPU build reproduces that exactly with a
``cuda:gloo`` group. Where a test needs a group without a CPU backend *and* tensors that exist on
its device, ``meta`` stands in for ``cuda`` and collectives are recorded rather than run.
"""

import pytest
import torch
import torch.distributed as dist

from fairseq_moe_ext.moe import comm
from fairseq_moe_ext.moe.collective_device import MoECollectiveDeviceError, collective_device, group_device_types
from fairseq_moe_ext.parallel import expert_grads, grad_norm


@pytest.fixture
def group_of_one():
    """A one-worker process group in this process, with the given backend config."""

    def make(backend):
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return dist.new_group([0])

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "config, device",
    [
        ("cuda:nccl", "cuda:3"),  # what plain "nccl" becomes
        ("nccl", "cuda:3"),
        ("cuda:gloo", "cuda:3"),
        ("cpu:gloo,cuda:gloo", "cpu"),  # what plain "gloo" becomes
        ("gloo", "cpu"),
        ("cpu:gloo,cuda:nccl", "cpu"),
        ("cuda:nccl,cpu:gloo", "cpu"),
    ],
)
def test_collective_device_is_the_cpu_only_where_the_group_has_a_cpu_backend(monkeypatch, config, device):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device(object()) == torch.device(device)


@pytest.mark.parametrize("backend, served", [("cuda:gloo", ("cuda",)), ("gloo", ("cpu", "cuda"))])
def test_the_device_types_a_group_serves_come_from_its_real_backend_config(group_of_one, backend, served):
    assert group_device_types(group_of_one(backend)) == served


def _data_path_calls(group):
    rows = torch.randn(3, 4)
    return {
        "all-reduce of routing statistics": lambda: comm.all_reduce_sum(rows, group),
        "all-to-all of token rows": lambda: comm.all_to_all(rows, [3], [3], group),
    }


@pytest.mark.parametrize("what", ["all-reduce of routing statistics", "all-to-all of token rows"])
def test_a_cpu_tensor_on_a_cuda_only_group_is_reported_as_a_plugin_bug_not_a_dead_peer(group_of_one, what):
    group = group_of_one("cuda:gloo")  # serves cuda only, like fairseq's plain nccl
    with pytest.raises(MoECollectiveDeviceError) as caught:
        _data_path_calls(group)[what]()
    message = str(caught.value)
    assert not isinstance(caught.value, comm.MoECommunicationError)
    assert f"MoE {what} was handed a tensor on cpu" in message and "'cuda:gloo'" in message
    assert "device mismatch bug in fairseq-moe-ext" in message
    assert "restart" not in message and "\n" not in message


@pytest.mark.parametrize(
    "backend_said, kind",
    [
        ("No backend type associated with device type cpu", MoECollectiveDeviceError),
        ("Tensors must be CUDA and dense", MoECollectiveDeviceError),
        ("Expected all tensors to be on the same device, but found at least two devices", MoECollectiveDeviceError),
        (
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4411",
            comm.MoECommunicationError,
        ),
        ("Timed out waiting 1800000ms for recv operation to complete", comm.MoECommunicationError),
    ],
)
def test_a_failed_collective_says_device_mismatch_or_dead_peer_by_what_the_backend_reported(
    group_of_one, monkeypatch, backend_said, kind
):
    group = group_of_one("gloo")

    def failing_all_reduce(*args, **kwargs):
        raise RuntimeError(backend_said)

    monkeypatch.setattr(dist, "all_reduce", failing_all_reduce)
    with pytest.raises(kind) as caught:
        comm.all_reduce_sum(torch.ones(2), group)
    message = str(caught.value)
    assert backend_said.split()[0] in message
    if kind is MoECollectiveDeviceError:
        assert "device mismatch bug" in message and "restart" not in message
    else:
        assert "a peer worker died or stalled" in message and "restart the job" in message


class ReachedCollective(Exception):
    """Stops a control path at its first collective (meta tensors hold no values to go on with)."""


def _record_collectives(monkeypatch):
    seen = []

    def recorder(op):
        def record(*args, **kwargs):
            tensors = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
            seen.append((op, sorted({t.device.type for t in tensors})))
            raise ReachedCollective(op)

        return record

    for op in ("all_gather", "all_reduce", "all_to_all_single", "all_gather_into_tensor", "broadcast"):
        monkeypatch.setattr(dist, op, recorder(op))
    return seen


def _model_with_grads():
    model = torch.nn.Linear(4, 3)
    model.weight.expert = True
    model(torch.randn(2, 4)).sum().backward()
    return model


# fmt: off
CONTROL_PATHS = {
    "layer set-up check": lambda g: comm.check_same_on_every_rank([4, 2, 2, 8, 2], list("abcde"), "MoE layer", g),
    "exchange of counts and sums": lambda g: comm.all_gather_row(torch.tensor([3.0, 1.0]), g),
    "all_gather_rows": lambda g: comm.all_gather_rows(torch.tensor([[0, 1], [1, 0]]), [2], g),
    "global grad norm": lambda g: grad_norm.global_grad_norm(_model_with_grads().parameters(), g),
    "replica gradient sum": lambda g: expert_grads.sum_expert_grads_over_replicas(_model_with_grads().parameters(), g),
    "shared-parameter fingerprints": lambda g: expert_grads.check_shared_parameters_agree(_model_with_grads(), g),
}
# fmt: on


@pytest.mark.parametrize("path", list(CONTROL_PATHS))
def test_no_control_collective_hands_a_cpu_tensor_to_a_group_without_a_cpu_backend(group_of_one, monkeypatch, path):
    group = group_of_one("gloo")
    # The group now says it serves only "meta", standing in for the cuda of a plain nccl group.
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "meta:nccl")
    seen = _record_collectives(monkeypatch)
    with pytest.raises(ReachedCollective):
        CONTROL_PATHS[path](group)
    assert seen and seen[0][1] == ["meta"], seen


def test_global_grad_norm_never_reads_a_value_back_to_the_host():
    # Gradients on "meta" cannot be copied to the host at all: any .cpu() or .item() would raise.
    params = [torch.nn.Parameter(torch.empty(3, 2, device="meta")) for _ in range(3)]
    for i, p in enumerate(params):
        p.grad = torch.empty(3, 2, device="meta")
        p.expert = i == 1
    assert grad_norm.global_grad_norm(params).device.type == "meta"


def test_global_grad_norm_is_bit_equal_to_the_fp64_sum_of_squared_fp32_norms():
    torch.manual_seed(0)
    # Many terms of mixed sizes: an fp32 accumulation would be off in the last bits.
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2000)]
    shared_sq = expert_sq = 0.0
    for i, p in enumerate(params):
        p.grad = torch.randn_like(p) * (1 + i % 7) ** 3
        p.expert = i % 2 == 1
        sq = float(torch.linalg.vector_norm(p.grad, dtype=torch.float32)) ** 2
        if p.expert:
            expert_sq += sq
        else:
            shared_sq += sq
    want = torch.tensor(shared_sq + expert_sq, dtype=torch.float64).sqrt().float()
    assert torch.equal(grad_norm.global_grad_norm(params), want)
