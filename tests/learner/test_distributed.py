"""Data parallelism: 2 gloo processes under torchrun with FSDP2 give the single-process update of the same batch.

One torchrun launch (tests/learner/dist_worker.py) runs every scenario, then writes a checkpoint and an export
from the sharded model; the comparisons run here, in one process, on the very same batch.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dgrpo.learner.records.checkpoint import load_checkpoint
from dgrpo.learner.update.distributed import balance_batch, contiguous_split

WORKER = Path(__file__).with_name("dist_worker.py")


def _worker_module():
    spec = importlib.util.spec_from_file_location("dgrpo_test_dist_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GLOO_ABORT = "exitcode  : -6"
"""How torchrun reports a rank killed by SIGABRT. Our code is Python and never aborts; gloo on CPU (this test's
backend only: devices run HCCL/NCCL) rarely does, mid-run, in its own threads (a core dump showed `free(): invalid
pointer` inside gloo::transport's Context::Mutator during an all-gather)."""


@pytest.fixture(scope="module")
def two_rank_run(child_processes, tiny_model, tmp_path_factory):
    for attempt in range(2):  # a second launch only after a gloo abort, said on stderr
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        out = tmp_path_factory.mktemp("dist")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(port), str(WORKER), str(tiny_model), str(out),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=420, env=env)
        if proc.returncode == 0 or attempt == 1 or GLOO_ABORT not in proc.stderr:
            break
        print(f"[test_distributed] a rank aborted (SIGABRT, gloo): launching once more\n{proc.stderr[-2000:]}",
              file=sys.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["padded", "packed", "skipped"])
def test_two_gloo_ranks_equal_one_process(two_rank_run, tiny_model, scenario):
    w = _worker_module()
    dist = torch.load(two_rank_run / f"{scenario}.pt", weights_only=False)
    single = w.make_actor(tiny_model, scenario)
    before = {n: p.detach().clone() for n, p in single.policy.named_parameters()}
    metrics = single.update(w.make_seqs(scenario), w.GROUP)
    after = dict(single.named_weights(torch.float32))
    assert set(after) == set(dist["weights"])
    assert any(not torch.equal(before[n], after[n]) for n in after)
    for name, tensor in after.items():
        # The reduction order differs; Adam's eps of 1e-5 keeps that float noise on ~0 gradients small.
        torch.testing.assert_close(dist["weights"][name], tensor, atol=3e-5, rtol=1e-4, msg=name)
        # Shards cast before their gather, in other buckets: the same bits as the gathered fp32 tensor cast.
        small = dist["small_buckets"][name]
        assert small.dtype == torch.bfloat16 and torch.equal(small, dist["weights"][name].to(torch.bfloat16)), name
    assert list(dist["small_buckets"]) == list(after)
    # Every metric: the two ranks' sums travel in one all-reduce and are read back by name.
    assert set(dist["metrics"]) == set(metrics)
    ignored = {"timing/logprob_s", "timing/update_s"}
    if metrics["actor/skipped_frac"] > 0:
        # Sequences without gradient are left out; each rank's share is topped up with copies of some out of the
        # loss: the tokens computed depend on the world size, the loss, gradient and token means do not.
        ignored |= {"actor/tokens", "actor/padding_frac", "actor/computed_tokens_ratio"}
        assert metrics["actor/tokens"] <= dist["metrics"]["actor/tokens"]
    for key in metrics.keys() - ignored:
        assert dist["metrics"][key] == pytest.approx(metrics[key], abs=1e-5, rel=1e-4), key


@pytest.mark.slow
def test_sharded_checkpoint_and_export_load_in_one_process(two_rank_run, tiny_model):
    from transformers import AutoModelForCausalLM

    w = _worker_module()
    dist = torch.load(two_rank_run / "packed.pt", weights_only=False)
    actor = w.make_actor(tiny_model, "packed")
    extra = load_checkpoint(actor, two_rank_run / "ckpt" / "step_1")
    assert extra == {"position": 7} and actor.step == 1
    for name, tensor in actor.named_weights(torch.float32):
        torch.testing.assert_close(tensor, dist["weights"][name], atol=0, rtol=0, msg=name)
    state = actor.optimizer.state_dict()["state"]
    assert len(state) == len(list(actor.policy.parameters())) and all(s["step"] == 1 for s in state.values())

    exported = AutoModelForCausalLM.from_pretrained(two_rank_run / "export")
    assert exported.config.dtype == torch.bfloat16
    q = "model.layers.1.mlp.down_proj.weight"
    torch.testing.assert_close(exported.state_dict()[q], dist["weights"][q].to(torch.bfloat16))


def test_balance_batch_evens_tokens_with_equal_counts():
    lengths = [100, 90, 10, 10, 50, 40, 5, 5]
    parts = balance_batch(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert [len(p) for p in parts] == [4, 4]
    totals = [sum(lengths[i] for i in p) for p in parts]
    contiguous = [sum(lengths[i] for i in p) for p in contiguous_split(8, 2)]
    assert max(totals) - min(totals) < max(contiguous) - min(contiguous)
    assert max(totals) - min(totals) <= 10
    with pytest.raises(ValueError, match="evenly over 3 ranks"):
        balance_batch(lengths, 3)
