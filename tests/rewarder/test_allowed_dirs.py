"""Who may reload what: reward files and models only from rewarder.allowed_dirs (symlinks and `..` resolved), and a
file that does not import never comes back to the client as text. The Reload cases run over a real gRPC channel
against a real server with real worker processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import yaml

from dgrpo.learner.rollout.reward_client import score_group
from dgrpo.rewarder.config import RewarderConfig
from dgrpo.rewarder.server import create_server
from dgrpo.rewarder.spec import SpecError, allowed_dirs, check_paths, parse_spec_text
from dgrpo.v1 import rewarder_pb2 as pb
from dgrpo.v1 import rewarder_pb2_grpc

CONST = "def reward_func(prompts, completions, **kw):\n    return [{v}] * len(completions)\n"


def _spec(path: Path | str, kind: str = "file") -> str:
    return yaml.safe_dump({"name": "x", "functions": [{"type": kind, "path": str(path)}]})


def test_default_allowed_dirs(tmp_path):
    (tmp_path / "rewards").mkdir()
    spec_file = tmp_path / "rewards" / "spec.yaml"
    # The spec file's folder; `..` and a symlinked file do not move it.
    assert allowed_dirs(RewarderConfig(spec_file=str(tmp_path / "rewards" / ".." / "rewards" / "spec.yaml"))) == [
        (tmp_path / "rewards").resolve()]
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "real.yaml").write_text("name: a\n")
    spec_file.symlink_to(tmp_path / "elsewhere" / "real.yaml")
    assert allowed_dirs(RewarderConfig(spec_file=str(spec_file))) == [(tmp_path / "rewards").resolve()]
    # An inline spec: the folders it names itself (a file's folder, a model's own folder); none for built-ins only.
    inline = RewarderConfig.model_validate({"spec": {"functions": [
        {"type": "file", "path": str(tmp_path / "a" / "r.py")}, {"type": "model", "path": str(tmp_path / "rm")},
        {"type": "math_verify"}]}})
    assert allowed_dirs(inline) == sorted([(tmp_path / "a").resolve(), (tmp_path / "rm").resolve()])
    assert allowed_dirs(RewarderConfig()) == []
    # Explicit folders win, resolved.
    explicit = RewarderConfig(spec_file=str(spec_file), allowed_dirs=[str(tmp_path / "x" / ".." / "y")])
    assert allowed_dirs(explicit) == [(tmp_path / "y").resolve()]


def test_check_paths(tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "rm").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (allowed / "link.py").symlink_to(tmp_path / "outside" / "evil.py")
    dirs = [allowed.resolve()]
    check_paths(parse_spec_text(_spec(allowed / "ok.py")), dirs)
    check_paths(parse_spec_text(_spec(allowed / "sub" / ".." / "ok.py")), dirs)
    check_paths(parse_spec_text(_spec(allowed / "rm", "model")), dirs)
    check_paths(parse_spec_text("functions: [{type: math_verify}]"), [])  # built-ins need no folder
    for path, kind in [(tmp_path / "outside" / "evil.py", "file"), (allowed / "link.py", "file"),
                       (allowed / ".." / "outside" / "evil.py", "file"), (tmp_path / "allowed-not" / "x.py", "file"),
                       (tmp_path / "outside", "model"), (allowed / "ok.py", "file")]:
        with pytest.raises(SpecError, match=r"functions\[0\]\.path .* is outside .*rewarder\.allowed_dirs"):
            check_paths(parse_spec_text(_spec(path, kind)), dirs if path != allowed / "ok.py" else [])


@pytest.mark.slow
def test_reload_is_confined_to_the_allowed_folders_over_grpc(child_processes, tmp_path, tiny_reward_model):
    rewards, outside = tmp_path / "rewards", tmp_path / "outside"
    rewards.mkdir()
    outside.mkdir()
    ran = tmp_path / "ran"  # the outside file writes this if it is ever executed
    evil = outside / "evil.py"
    evil.write_text(f"open({str(ran)!r}, 'w').write('ran')\n" + CONST.format(v=9.0))
    (rewards / "good.py").write_text(CONST.format(v=1.0))
    (rewards / "good2.py").write_text(CONST.format(v=2.0))
    (rewards / "link.py").symlink_to(evil)
    (rewards / "model-link").symlink_to(tiny_reward_model)
    (rewards / "secret.txt").write_text("TOPSECRET_abc123\n")
    (rewards / "secret.py").write_text("x = 1\nTOPSECRET_def456\n")
    (rewards / "secret_syntax.py").write_text("x = 1\ntoken = 'TOPSECRET_ghi789\n")
    spec_file = rewards / "spec.yaml"
    spec_file.write_text(_spec(rewards / "good.py"))
    config = RewarderConfig(host="127.0.0.1", port=0, spec_file=str(spec_file), workers=1)

    refused = {
        "outside": _spec(evil),
        "symlink": _spec(rewards / "link.py"),
        "traversal": _spec(f"{rewards}/../outside/evil.py"),
        "model outside": _spec(tiny_reward_model, "model"),
        "model symlink": _spec(rewards / "model-link", "model"),
    }
    secrets = {"secret.txt": "TOPSECRET_abc123", "secret.py": "TOPSECRET_def456",
               "secret_syntax.py": "TOPSECRET_ghi789"}

    async def scenario():
        server, scorer = create_server(config)
        await server.start()
        await scorer.start()
        details: dict[str, tuple] = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = rewarder_pb2_grpc.RewarderStub(channel)
                request = pb.ScoreRequest(groups=[score_group("q", "p", ["a", "b"], {})])

                async def reward() -> tuple[int, float]:
                    response = await stub.Score(request, timeout=60)
                    return response.spec.version, response.groups[0].scores[0].reward

                for case, text in [*refused.items(), *((name, _spec(rewards / name)) for name in secrets)]:
                    try:
                        await stub.Reload(pb.ReloadRequest(spec_text=text), timeout=120)
                        details[case] = ("accepted",)
                    except grpc.aio.AioRpcError as e:
                        details[case] = (e.code(), e.details(), await reward())
                allowed = await stub.Reload(pb.ReloadRequest(spec_text=_spec(rewards / "good2.py")), timeout=120)
                after = await reward()
        finally:
            await scorer.close()
            await server.stop(0)
        return details, allowed, after

    details, allowed, after = asyncio.run(scenario())
    for case in refused:
        assert details[case] != ("accepted",), case
        code, message, served = details[case]
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (case, details[case])
        assert "functions[0].path" in message and "rewarder.allowed_dirs" in message, case
        assert served == (1, 1.0), f"{case}: the old spec keeps serving"
    assert str(evil) in details["outside"][1] and "link.py" in details["symlink"][1]  # the path as given
    assert not ran.exists(), "the outside file was executed"
    for name, token in secrets.items():
        assert details[name] != ("accepted",), name
        code, message, served = details[name]
        assert code == grpc.StatusCode.INVALID_ARGUMENT and served == (1, 1.0), (name, details[name])
        assert token not in message and name in message, (name, message)
    assert "does not import: NameError at line 1 " in details["secret.txt"][1]
    assert "does not import: NameError at line 2 " in details["secret.py"][1]
    assert "does not import: SyntaxError at line 2 " in details["secret_syntax.py"][1]
    assert allowed.changed and allowed.spec.version == 2 and after == (2, 2.0)
