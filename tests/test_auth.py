"""The shared token (common/auth.py) over real servers and channels: calls without it or with a wrong one fail
UNAUTHENTICATED without echoing a token, the right one is served, health and reflection stay open; the token comes
from a file or DGRPO_TOKEN and never from the config; services bind loopback by default and compose binds
0.0.0.0 only inside containers, publishing on the host's loopback."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from dgrpo.cli.main import main as dgrpo_main
from dgrpo.cli.stack import StackConfig
from dgrpo.common import auth
from dgrpo.common.auth_config import TOKEN_ENV, AuthConfig, Credentials
from dgrpo.common.config import ConfigError, load_config
from dgrpo.learner.config import RolloutConfig
from dgrpo.learner.records.control import LoopState, start_control_server
from dgrpo.learner.rollout.client import RolloutClient
from dgrpo.learner.rollout.reward_client import RewardClient, RewardError, score_group
from dgrpo.sampler import server as sampler_server
from dgrpo.sampler.config import SamplerConfig
from dgrpo.v1 import learner_pb2, learner_pb2_grpc, sampler_pb2, sampler_pb2_grpc

TOKEN = "right-token-0123456789abcdef"
WRONG = "wrong-token-fedcba9876543210"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def _status(port: int, token: str | None, metadata=None):
    async def call():
        async with auth.channel(f"127.0.0.1:{port}", Credentials(token)) as channel:
            return await learner_pb2_grpc.LearnerStub(channel).Status(learner_pb2.StatusRequest(), timeout=5,
                                                                      metadata=metadata)
    return call()


async def _error(awaitable) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable
    return info.value


def test_control_service_requires_the_token_and_health_and_reflection_stay_open():
    async def scenario():
        state = LoopState(step=7)
        server = await start_control_server(state, "127.0.0.1", 0, credentials=Credentials(TOKEN))
        try:
            port = server.port
            missing = await _error(_status(port, None))
            wrong = await _error(_status(port, WRONG))
            bare = await _error(_status(port, None, metadata=(("authorization", TOKEN),)))  # no "Bearer "
            served = await _status(port, TOKEN)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:  # no token at all
                stub = learner_pb2_grpc.LearnerStub(channel)
                stop = await _error(stub.Stop(learner_pb2.StopRequest(reason="takeover"), timeout=5))
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            services = await asyncio.to_thread(_reflected, port)
            async with auth.channel(f"127.0.0.1:{port}", Credentials(TOKEN)) as channel:
                stopped = await learner_pb2_grpc.LearnerStub(channel).Stop(learner_pb2.StopRequest(reason="ok"),
                                                                           timeout=5)
        finally:
            await server.stop(0)
        return missing, wrong, bare, served, stop, health, services, stopped, state

    missing, wrong, bare, served, stop, health, services, stopped, state = asyncio.run(scenario())
    for err in (missing, wrong, bare, stop):
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
        assert TOKEN not in err.details() and WRONG not in err.details()
        assert "authorization: Bearer <token>" in err.details()
    assert "no `authorization` metadata" in missing.details()
    assert "does not match" in wrong.details()
    assert served.step == 7
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert "dgrpo.v1.Learner" in services
    assert stopped.stopping_after_step == 8 and state.stop_reason == "ok"  # only the authenticated Stop counted


def _reflected(port: int) -> set[str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return set(ProtoReflectionDescriptorDatabase(channel).get_services())


def test_no_token_serves_everyone_as_before():
    async def scenario():
        server = await start_control_server(LoopState(step=3), "127.0.0.1", 0)
        try:
            return await _status(server.port, None), await _status(server.port, WRONG)
        finally:
            await server.stop(0)

    plain, with_token = asyncio.run(scenario())
    assert plain.step == with_token.step == 3


def test_sampler_server_guards_streams_and_the_rollout_client_sends_the_token(child_processes):
    """Generate is a server stream: an unauthenticated one is refused before the servicer runs; an authenticated
    one reaches it (no engine attached: UNAVAILABLE, "still loading")."""
    async def generate(port, token):
        async with auth.channel(f"127.0.0.1:{port}", Credentials(token)) as channel:
            call = sampler_pb2_grpc.SamplerStub(channel).Generate(sampler_pb2.GenerateRequest(), timeout=5)
            return await _error(_drain(call))

    async def scenario():
        server, _ = sampler_server.create_server(SamplerConfig(port=0), Credentials(TOKEN))
        await server.start()
        try:
            address = f"127.0.0.1:{server.port}"
            results = [await generate(server.port, None), await generate(server.port, WRONG),
                       await generate(server.port, TOKEN)]
            for token in (None, TOKEN):
                client = RolloutClient([address], RolloutConfig(), credentials=Credentials(token))
                try:
                    results.append(await _error(client.info(address, timeout=5)))
                finally:
                    await client.close()
        finally:
            await server.stop(0)
        return results

    no_token, wrong, right, info_no_token, info_right = asyncio.run(scenario())
    assert no_token.code() == wrong.code() == info_no_token.code() == grpc.StatusCode.UNAUTHENTICATED
    assert right.code() == info_right.code() == grpc.StatusCode.UNAVAILABLE
    assert "still loading" in right.details() and "still loading" in info_right.details()


async def _drain(call) -> None:
    async for _ in call:
        pass


@pytest.mark.slow
def test_reward_client_against_a_rewarder_process_started_with_the_token(service_factory, free_port, tmp_path):
    """`dgrpo rewarder` reads DGRPO_TOKEN (as under `dgrpo up` or compose); the learner's RewardClient with the
    token scores, without it is rejected at once (UNAUTHENTICATED is not retried)."""
    port = free_port()
    svc = service_factory("rewarder", [f"rewarder.port={port}", "rewarder.host=127.0.0.1", "rewarder.workers=1",
                                       "rewarder.grace_s=1"], port=port, env={TOKEN_ENV: TOKEN})
    svc.wait_ready(timeout=120)  # health answers without the token
    group = score_group("q1", "1+2?", ["\\boxed{3}", "\\boxed{4}"], {"answer": "3"})

    async def scenario():
        good = RewardClient(svc.address, timeout_s=30, credentials=Credentials(TOKEN))
        bad = RewardClient(svc.address, timeout_s=30)
        try:
            reward = await good.score(group)
            with pytest.raises(RewardError) as rejected:
                await bad.score(group)
            info_error = await _error(bad.info(timeout=10))
        finally:
            await good.close()
            await bad.close()
        return reward, rejected.value, info_error

    reward, rejected, info_error = asyncio.run(scenario())
    assert reward.rewards == [1.0, 0.0]
    assert "UNAUTHENTICATED" in str(rejected) and TOKEN not in str(rejected)
    assert info_error.code() == grpc.StatusCode.UNAUTHENTICATED


# ---- where the token comes from ---------------------------------------------------------------------------------


def test_token_from_file_then_env_and_none_without_either(tmp_path, monkeypatch):
    assert AuthConfig().token() is None
    monkeypatch.setenv(TOKEN_ENV, "")  # compose's ${DGRPO_TOKEN:-} when unset
    assert AuthConfig().token() is None
    monkeypatch.setenv(TOKEN_ENV, f"  {TOKEN}\n")
    assert AuthConfig().token() == TOKEN
    token_file = tmp_path / "token"
    token_file.write_text(WRONG + "\n")
    cfg = load_config(StackConfig, None, [f"auth.token_file={token_file}"])
    assert cfg.auth.token() == WRONG  # the file wins over the environment
    assert cfg.learner_run().auth.token() == WRONG  # and reaches the learner


def test_unusable_tokens_fail_without_showing_them(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="auth.token_file=.*cannot be read"):
        AuthConfig(token_file=tmp_path / "missing").token()
    monkeypatch.setenv(TOKEN_ENV, "short-secret")
    with pytest.raises(ConfigError, match=r"\$DGRPO_TOKEN has 12 characters; use at least 16") as short:
        AuthConfig().token()
    assert "short-secret" not in str(short.value)
    monkeypatch.setenv(TOKEN_ENV, "a token with spaces in it")
    with pytest.raises(ConfigError, match="without spaces") as spaced:
        AuthConfig().token()
    assert "with spaces in" not in str(spaced.value)


def test_a_token_in_the_config_or_on_the_command_line_is_refused(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"auth\.token cannot be set") as override:
        load_config(StackConfig, None, [f"auth.token={TOKEN}"])
    config_file = tmp_path / "stack.yaml"
    config_file.write_text(yaml.safe_dump({"auth": {"token": TOKEN}}))
    with pytest.raises(ConfigError, match=r"auth\.token cannot be set") as in_yaml:
        load_config(StackConfig, config_file)
    for err in (override.value, in_yaml.value):
        assert TOKEN not in str(err) and "auth.token_file" in str(err) and TOKEN_ENV in str(err)
    assert dgrpo_main(["rewarder", f"auth.token={TOKEN}"]) == 2
    stderr = capsys.readouterr().err
    assert "auth.token cannot be set" in stderr and TOKEN not in stderr


# ---- where the services listen ----------------------------------------------------------------------------------


def test_services_bind_loopback_by_default():
    cfg = StackConfig()
    assert cfg.sampler.host == cfg.rewarder.host == cfg.learner.trainer.control_host == "127.0.0.1"


COMPOSE_BINDS = {"sampler": "sampler.host=0.0.0.0", "rewarder": "rewarder.host=0.0.0.0",
                 "learner": "learner.trainer.control_host=0.0.0.0"}


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.cuda.yml", "docker-compose.npu.yml"])
def test_compose_binds_all_interfaces_inside_containers_and_publishes_on_host_loopback(name):
    """Each file as written (the override files replace whole commands): inside the compose network every service
    must be reachable, so it binds 0.0.0.0; a published port is on the host's 127.0.0.1 only."""
    compose = yaml.safe_load((ROOT / "deploy" / name).read_text())
    for svc_name, svc in compose["services"].items():
        command = svc.get("command")
        if command and command[0] == "dgrpo":  # (`shm` sleeps, `token` writes a file; neither serves)
            assert COMPOSE_BINDS[command[1]] in command, f"{name}: {svc_name} binds the loopback default"
        for published in svc.get("ports", []):
            assert str(published).startswith("127.0.0.1:"), f"{name}: {svc_name} publishes {published} on every "\
                                                              "interface of the host"
    if name == "docker-compose.yml":
        # The token reaches the one-shot `token` service only; the others read the file it writes.
        assert compose["services"]["token"]["environment"][TOKEN_ENV] == "${DGRPO_TOKEN:-}"
        assert TOKEN_ENV not in compose["x-dgrpo"]["environment"]


def test_compose_token_is_given_kept_or_generated_owner_only(child_processes, tmp_path, monkeypatch):
    """deploy/docker-compose.yml's `token` service: DGRPO_TOKEN if set, else the earlier start's, else a fresh one;
    the file 0600; a token every service would refuse stops it, naming the variable and never the token."""
    from dgrpo.cli.token import ensure_token

    path = tmp_path / "secrets" / "token"
    monkeypatch.delenv("DGRPO_TOKEN", raising=False)
    assert ensure_token(path) == "generated"
    first = path.read_text().strip()
    assert len(first) >= 32 and path.stat().st_mode & 0o777 == 0o600
    assert ensure_token(path) == "kept" and path.read_text().strip() == first
    monkeypatch.setenv("DGRPO_TOKEN", "chosen-by-the-operator-0123")
    assert ensure_token(path) == "given" and path.read_text().strip() == "chosen-by-the-operator-0123"
    bad = subprocess.run([sys.executable, "-m", "dgrpo.cli.token", str(path)], capture_output=True, text=True,
                         env={**os.environ, "DGRPO_TOKEN": "short"}, check=False)
    assert bad.returncode == 2 and "$DGRPO_TOKEN has 5 characters" in bad.stderr and "short" not in bad.stdout
    assert path.read_text().strip() == "chosen-by-the-operator-0123"  # the refused one was not written
