"""weights.transport=collective on device backends (weights/collective_backends.py): nccl / hccl stage every chunk
through device memory with vLLM's / vllm-ascend's communicator, and a switched-off communicator is refused.

Here (no GPU, no NPU) the device and its communicator are fakes (fake_device.py: host memory, and bytes moved by a
real gloo group between real sockets); the learner's publisher, its host links, the relay, the host's shared-memory
slots, the checksums and the subscriber loading into a torch target are the real ones, on loopback. The tests marked
`cuda` / `npu` run the same exchange with the real communicator between two processes on two devices.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dgrpo.common import devices
from dgrpo.weights import collective_backends
from dgrpo.weights.collective_group import CollectiveError, CollectiveRefused, PairGroup, listen_socket
from dgrpo.weights.config import WeightSyncConfig
from dgrpo.weights.publisher import WeightPublisher
from dgrpo.weights.subscriber import WeightSubscriber

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import fake_device

SHAPES = {f"model.layers.{i}.w": [64, 96 + 32 * i] for i in range(3)}  # ~60 kB bf16: several 16 kB-ish chunks


def weights(version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {name: torch.randint(-100, 100, shape, generator=gen).float() for name, shape in SHAPES.items()}


def module_target(shapes):
    spec = importlib.util.spec_from_file_location("channel_peer", HERE / "channel_peer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ModuleTarget(shapes, emit=lambda *a, **k: None)


@pytest.fixture
def fake_nccl(monkeypatch):
    """Install a fake nccl backend (the fake device is "cpu"-typed: its memory is host memory)."""
    fake_device.FakeCommunicator.log = fake_device.Log()

    def install(communicator=fake_device.FakeCommunicator, preflight=lambda: None) -> fake_device.FakeBackend:
        backend = fake_device.fake_backend(communicator, preflight)
        monkeypatch.setitem(collective_backends.DEVICE_BACKENDS, "nccl", backend)
        monkeypatch.setitem(devices.WEIGHT_BACKEND_DEVICES, "nccl", "cpu")
        return backend

    return install


def collective_cfg(sync_cfg, **overrides) -> WeightSyncConfig:
    return sync_cfg(**{"transport": "collective", "collective_backend": "nccl", "collective_timeout_s": 2.0,
                       "collective_chunk_mb": 1, "catch_up_timeout_s": 10.0, "fetch_timeout_s": 10.0, **overrides})


def follow(pub: WeightPublisher, cfg: WeightSyncConfig, versions: list[int], wait_s: float = 15.0):
    """Publish `versions` one by one to a replica (relay included) in this process; the target it loaded into."""
    target = module_target(SHAPES)

    async def run() -> None:
        subscriber = WeightSubscriber(cfg, target, SHAPES)
        await subscriber.start()
        try:
            for v in versions:
                pub.publish(list(weights(v).items()), v)
                deadline = time.monotonic() + wait_s
                while target.weight_version < v and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
        finally:
            await subscriber.stop()

    asyncio.run(run())
    return target


def test_versions_cross_through_device_staging_bit_for_bit(sync_cfg, fake_nccl, caplog):
    caplog.set_level(logging.INFO)
    fake_nccl()
    cfg = collective_cfg(sync_cfg)
    with WeightPublisher(cfg, "devnccl", device="cpu") as pub:
        target = follow(pub, cfg, [1, 2])
        assert target.weight_version == 2, caplog.text[-3000:]
        for name, tensor in weights(2).items():
            assert torch.equal(target.state[name], tensor.to(torch.bfloat16)), name
        (host,) = pub.hosts.values()
        assert host.acked == 2 and host.failures == 0
    log = fake_device.FakeCommunicator.log
    assert sorted(rank for rank, _ in log.built) == [0, 1]  # one communicator per end
    assert "joined (collective group, nccl)" in caplog.text
    body = pub.latest.nbytes - 4096
    assert max(log.broadcast_bytes) <= 1 << 20 and sum(log.broadcast_bytes) >= 2 * body  # both versions, chunked


def test_a_switched_off_communicator_is_refused_on_both_ends_naming_the_setting(sync_cfg, fake_nccl, caplog):
    # vLLM 0.32's PyNcclCommunicator without libnccl: `disabled`, and every collective returns at once.
    fake_nccl(fake_device.SwitchedOffCommunicator)
    cfg = collective_cfg(sync_cfg, catch_up_timeout_s=3.0, fetch_timeout_s=3.0)
    with WeightPublisher(cfg, "devoff", device="cpu") as pub:
        target = follow(pub, cfg, [1], wait_s=4.0)
        assert target.weight_version == 0  # nothing "loaded" from bytes that never moved
        (host,) = pub.hosts.values()
        assert host.acked == 0 and host.failures >= 1
    refusals = [r.getMessage() for r in caplog.records if "over nccl refused" in r.getMessage()]
    assert any("over nccl refused on the learner: the nccl communicator came up switched off" in m for m in refusals)
    assert any("refused on the sampler's relay" in m for m in refusals), refusals
    assert all("weights.collective_backend=gloo" in m for m in refusals)
    assert fake_device.FakeCommunicator.log.broadcast_bytes == []


@pytest.mark.parametrize(("missing", "hears"), [("sampler's relay", "learner"), ("learner", "sampler's relay")])
def test_an_end_without_the_library_refuses_and_the_other_end_hears_why(sync_cfg, fake_nccl, caplog, missing, hears):
    # One end cannot load its library (the check runs in that end's thread: the relay's, or the learner's host link).
    threads = {"sampler's relay": ("dgrpo-relay",), "learner": ("dgrpo-weights-",)}

    def preflight():
        return "libnccl could not be loaded (fake)" if threading.current_thread().name.startswith(
            threads[missing]) else None

    fake_nccl(preflight=preflight)
    cfg = collective_cfg(sync_cfg, catch_up_timeout_s=3.0, fetch_timeout_s=3.0)
    with WeightPublisher(cfg, "devnolib", device="cpu") as pub:
        target = follow(pub, cfg, [1], wait_s=3.0)
    assert target.weight_version == 0
    heard = [r.getMessage() for r in caplog.records if r.threadName.startswith(threads[hears])]
    assert any(f"over nccl refused on the {missing}: libnccl could not be loaded (fake)" in m for m in heard), heard
    assert fake_device.FakeCommunicator.log.built == []  # neither end built a communicator that could not work


def test_bytes_that_never_moved_fail_the_relays_checksums_and_are_never_served(sync_cfg, fake_nccl, caplog):
    # A communicator that passes every check but moves no version body: what the relay verifies is not what was sent.
    fake_nccl(fake_device.BodylessCommunicator)
    cfg = collective_cfg(sync_cfg, catch_up_timeout_s=3.0, fetch_timeout_s=3.0)
    with WeightPublisher(cfg, "devbody", device="cpu") as pub:
        target = follow(pub, cfg, [1], wait_s=4.0)
        (host,) = pub.hosts.values()
        assert host.acked == 0 and host.failures >= 1
    assert target.weight_version == 0
    assert "REJECTED weight version 1 from the learner" in caplog.text
    assert "REJECTED version 1 (its relay's checksums did not verify)" in caplog.text


def test_a_relay_whose_backend_setting_differs_is_refused_naming_both(sync_cfg, fake_nccl, caplog):
    fake_nccl()
    cfg = collective_cfg(sync_cfg, catch_up_timeout_s=2.0, fetch_timeout_s=2.0)
    sampler_cfg = cfg.model_copy(update={"collective_backend": "gloo"})
    with WeightPublisher(cfg, "devmismatch", device="cpu") as pub:
        target = follow(pub, sampler_cfg, [1], wait_s=2.0)
    assert target.weight_version == 0
    assert ("the learner's group is nccl (its weights.collective_backend), this sampler's "
            "weights.collective_backend is 'gloo'") in caplog.text


def test_a_relay_on_a_host_without_the_device_refuses(sync_cfg, fake_nccl, caplog):
    fake_nccl().fake_module.available = False
    cfg = collective_cfg(sync_cfg, catch_up_timeout_s=2.0, fetch_timeout_s=2.0)
    with WeightPublisher(cfg, "devnodev", device="cpu") as pub:
        target = follow(pub, cfg, [1], wait_s=2.0)
    assert target.weight_version == 0
    assert "over nccl refused on the sampler's relay: this sampler sees no cpu device" in caplog.text


def pair(backend: str = "nccl", timeout_s: float = 2.0) -> tuple[PairGroup, PairGroup]:
    """Both ends of one group on loopback (each formed in its own thread, as they rendezvous together)."""
    sock = listen_socket("127.0.0.1")
    port = sock.getsockname()[1]
    device = torch.device("cpu")
    ends: dict[int, PairGroup | BaseException] = {}

    def form(rank: int) -> None:
        try:
            ends[rank] = PairGroup(rank, "127.0.0.1", port, timeout_s, "127.0.0.1", backend,
                                   listen=sock if rank == 0 else None, device=device)
        except BaseException as e:  # noqa: BLE001
            ends[rank] = e

    threads = [threading.Thread(target=form, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    for end in ends.values():
        if isinstance(end, BaseException):
            raise end
    return ends[0], ends[1]


def test_a_device_collective_whose_peer_stops_answering_fails_within_the_timeout(fake_nccl):
    fake_nccl()
    learner, relay = pair(timeout_s=1.0)
    head = torch.tensor([1, 2, 3], dtype=torch.int64)
    got = torch.zeros(3, dtype=torch.int64)
    t = threading.Thread(target=relay.broadcast, args=(got,))
    t.start()
    learner.broadcast(head)
    t.join(5)
    assert got.tolist() == [1, 2, 3]  # through the staging buffers, back to the host tensor
    ack = torch.tensor([7], dtype=torch.int64)
    mine = torch.zeros(1, dtype=torch.int64)
    t = threading.Thread(target=relay.allreduce, args=(ack,))
    t.start()
    learner.allreduce(mine)
    t.join(5)
    assert mine.item() == 7 and ack.item() == 7

    t0 = time.monotonic()  # the relay takes no part in the next one: the broadcast is enqueued and never completes
    with pytest.raises(CollectiveError, match="nccl broadcast did not complete within 1s"):
        learner.broadcast(head)
    assert time.monotonic() - t0 < 3
    learner.abort()
    relay.abort()
    deadline = time.monotonic() + 5
    while fake_device.FakeCommunicator.log.destroyed < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake_device.FakeCommunicator.log.destroyed == 2  # vLLM's destroy (ncclCommAbort) on both ends


def test_a_communicator_that_never_forms_fails_within_the_timeout(fake_nccl):
    class Hanging(fake_device.FakeCommunicator):
        def __init__(self, group, device):
            threading.Event().wait(30)  # ncclCommInitRank waiting for a peer that never comes

    fake_nccl(Hanging)
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match="the nccl communicator did not form within 1s"):
        pair(timeout_s=1.0)
    assert time.monotonic() - t0 < 5


def test_a_device_backend_needs_its_device():
    sock = listen_socket("127.0.0.1")
    with pytest.raises(CollectiveRefused, match="over nccl refused on the learner: this end's device is cpu"):
        PairGroup(0, "127.0.0.1", 0, 1.0, "127.0.0.1", "nccl", listen=sock, device=torch.device("cpu"))


# --- configuration: backend vs device, bad combinations ------------------------------------------------------------


@pytest.mark.parametrize(("setting", "device", "expected"), [
    ("auto", "cpu", "gloo"), ("auto", "cuda", "nccl"), ("auto", "npu", "hccl"),
    ("gloo", "cuda", "gloo"), ("gloo", "npu", "gloo"), ("nccl", "cuda", "nccl"), ("hccl", "npu", "hccl"),
])
def test_the_backend_follows_the_device_or_the_setting(setting, device, expected):
    assert devices.weight_collective_backend(setting, device) == expected


@pytest.mark.parametrize(("setting", "device", "needs"), [
    ("nccl", "cpu", "cuda"), ("nccl", "npu", "cuda"), ("hccl", "cpu", "npu"), ("hccl", "cuda", "npu"),
])
def test_a_backend_on_the_wrong_device_is_refused_naming_key_and_value(setting, device, needs):
    with pytest.raises(ValueError, match=f"weights.collective_backend={setting} needs model.device={needs}, but this "
                                         f"process runs on '{device}'"):
        devices.weight_collective_backend(setting, device)


def test_a_learner_on_cpu_with_nccl_refuses_to_start(sync_cfg):
    cfg = sync_cfg(transport="collective", collective_backend="nccl")
    with pytest.raises(ValueError, match="weights.collective_backend=nccl needs model.device=cuda"):
        WeightPublisher(cfg, "cpunccl", device="cpu")


def test_a_backend_without_the_collective_transport_is_a_config_error():
    with pytest.raises(ValueError, match="weights.collective_backend=nccl applies to weights.transport=collective "
                                         "only, and weights.transport is 'shm'"):
        WeightSyncConfig(collective_backend="nccl")
    with pytest.raises(ValueError, match="collective_backend"):
        WeightSyncConfig(transport="collective", collective_backend="mpi")
    assert WeightSyncConfig(transport="collective", collective_backend="hccl").collective_backend == "hccl"


def test_the_whole_stack_refuses_an_explicit_device_without_the_backend():
    from dgrpo.cli.stack import StackConfig
    from dgrpo.common.config import ConfigError

    cfg = StackConfig.model_validate({"model": {"device": "cpu"},
                                      "weights": {"transport": "collective", "collective_backend": "hccl"}})
    with pytest.raises(ConfigError, match="weights.collective_backend=hccl needs model.device=npu, but this process "
                                          "runs on 'cpu'"):
        cfg.check_whole_stack()
    StackConfig.model_validate({
        "model": {"device": "cpu"}, "weights": {"transport": "collective", "collective_backend": "gloo"},
    }).check_whole_stack()


# --- the real communicators, where the devices exist ---------------------------------------------------------------


def _devices(kind: str) -> int:
    try:
        module = collective_backends.DEVICE_BACKENDS[{"cuda": "nccl", "npu": "hccl"}[kind]].module()
        return module.device_count() if module.is_available() else 0
    except ImportError:
        return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PEER = """
import socket, sys, torch
from dgrpo.weights.collective_group import CollectiveError, PairGroup
rank, port, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
backend = {"cuda": "nccl", "npu": "hccl"}[kind]
listen = None
if rank == 0:  # the learner's end serves the store on a socket it bound itself
    listen = socket.socket()
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listen.bind(("127.0.0.1", port))
    listen.listen(8)
try:
    g = PairGroup(rank, "127.0.0.1", port, 60.0, "127.0.0.1", backend, listen=listen, device=torch.device(kind, 0))
except CollectiveError as e:
    print("REFUSED", e, flush=True)
    sys.exit(0)
data = torch.arange(3 << 20, dtype=torch.int64) if rank == 0 else torch.zeros(3 << 20, dtype=torch.int64)
g.broadcast(data.view(torch.uint8))
ack = torch.tensor([int(data.sum() % 1000003) if rank == 1 else 0])
g.allreduce(ack)
print("ACK", int(ack.item()), flush=True)
"""


def _real_pair(kind: str, tmp_path, env1: dict[str, str] | None = None) -> list[str]:
    """Rank 0 on device 0, rank 1 on device 1, each in its own process (NCCL / HCCL refuse two ranks on one device):
    24 MB of host bytes through the real communicator, then the acknowledgement back."""
    visible, port = devices.VISIBLE_DEVICES_ENV[kind], _free_port()
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(port), kind], text=True,
                              env={**os.environ, visible: str(rank), **(env1 if rank == 1 else {})},
                              stdout=subprocess.PIPE) for rank in (0, 1)]
    return [p.communicate(timeout=180)[0] for p in procs]


def _expected_ack() -> str:
    return f"ACK {int(torch.arange(3 << 20, dtype=torch.int64).sum() % 1000003)}"


@pytest.mark.cuda
@pytest.mark.skipif(_devices("cuda") < 2, reason="needs 2 CUDA GPUs (NCCL refuses two ranks on one GPU); "
                                                  f"this machine has {_devices('cuda')}")
def test_nccl_pair_moves_host_bytes_through_two_gpus(tmp_path):
    outs = _real_pair("cuda", tmp_path)
    assert all(_expected_ack() in out for out in outs), outs


@pytest.mark.cuda
@pytest.mark.skipif(_devices("cuda") < 2, reason="needs 2 CUDA GPUs (NCCL refuses two ranks on one GPU); "
                                                  f"this machine has {_devices('cuda')}")
def test_nccl_with_vllms_communicator_switched_off_is_refused_on_both_ends(tmp_path):
    outs = _real_pair("cuda", tmp_path, {"VLLM_DISABLE_PYNCCL": "1"})
    assert "REFUSED" in outs[0] and "refused on the sampler's relay: VLLM_DISABLE_PYNCCL is set" in outs[0], outs
    assert "refused on the sampler's relay: VLLM_DISABLE_PYNCCL is set" in outs[1], outs


@pytest.mark.npu
@pytest.mark.skipif(_devices("npu") < 2, reason="needs 2 Ascend NPUs with torch_npu and vllm-ascend (HCCL refuses "
                                                 f"two ranks on one NPU); this machine has {_devices('npu')}")
def test_hccl_pair_moves_host_bytes_through_two_npus(tmp_path):
    outs = _real_pair("npu", tmp_path)
    assert all(_expected_ack() in out for out in outs), outs
