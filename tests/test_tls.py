"""Optional TLS and mutual TLS (auth.tls, common/auth.py) with throwaway certificates made here: a real rewarder
process with mutual TLS refuses plaintext, a client trusting another CA and a client without a certificate, and
serves a client with a certificate from the CA and the token; `dgrpo up`'s health poll and deploy/healthcheck.py
reach health over TLS; the learner's control server with server-only TLS still requires the token; bad settings
fail at load naming the key, and the private key never shows."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dgrpo.cli.launch.supervisor import Service, Stack
from dgrpo.cli.stack import StackConfig
from dgrpo.common import auth
from dgrpo.common.auth_config import TOKEN_ENV, AuthConfig, Credentials, TlsMaterial
from dgrpo.common.config import ConfigError, load_config
from dgrpo.learner.records.control import LoopState, start_control_server
from dgrpo.learner.rollout.reward_client import RewardClient, score_group
from dgrpo.v1 import learner_pb2, learner_pb2_grpc, rewarder_pb2, rewarder_pb2_grpc

TOKEN = "tls-test-token-0123456789abcdef"
PROBE = Path(__file__).resolve().parents[1] / "deploy" / "healthcheck.py"


# ---- a throwaway PKI ---------------------------------------------------------------------------------------------


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(name: str, key, issuer: x509.Certificate | None = None, issuer_key=None, *, ca: bool = False,
          san: list[x509.GeneralName] | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer.subject if issuer is not None else subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def _write(folder: Path, name: str, cert: x509.Certificate, key=None, password: bytes | None = None) -> None:
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        encryption = (serialization.BestAvailableEncryption(password) if password
                      else serialization.NoEncryption())
        (folder / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                               serialization.PrivateFormat.PKCS8, encryption))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """ca.pem; server.pem/.key (SAN localhost, 127.0.0.1) and client.pem/.key from it; other_ca.pem and
    stranger.pem/.key from another CA; locked.key: the server key under a passphrase."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, other_key = _key(), _key()
    ca, other = _cert("dgrpo test CA", ca_key, ca=True), _cert("another CA", other_key, ca=True)
    _write(d, "ca", ca)
    _write(d, "other_ca", other)
    server_key = _key()
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    _write(d, "server", _cert("server", server_key, ca, ca_key, san=san), server_key)
    client_key, stranger_key = _key(), _key()
    _write(d, "client", _cert("learner", client_key, ca, ca_key), client_key)
    _write(d, "stranger", _cert("stranger", stranger_key, other, other_key), stranger_key)
    _write(d, "locked", _cert("server", server_key, ca, ca_key, san=san), server_key, password=b"secret")
    return d


def _tls(pki: Path, ca: str = "ca", identity: str | None = None) -> TlsMaterial:
    """A client's TLS material: trusting `ca`, presenting `identity`'s certificate (None: none)."""
    return TlsMaterial(root_certificates=(pki / f"{ca}.pem").read_bytes(),
                       certificate_chain=(pki / f"{identity}.pem").read_bytes() if identity else None,
                       private_key=(pki / f"{identity}.key").read_bytes() if identity else None)


def _probe(port: int, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROBE), str(port), *flags], capture_output=True, text=True, timeout=60,
                          check=False)


async def _error(awaitable) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable
    return info.value


# ---- a rewarder process with mutual TLS --------------------------------------------------------------------------


@pytest.mark.slow
def test_rewarder_with_mutual_tls_serves_only_clients_with_a_certificate_from_its_ca(pki, service_factory, free_port,
                                                                                     tmp_path):
    port = free_port()
    stack_yaml = tmp_path / "stack.yaml"
    stack_yaml.write_text(yaml.safe_dump({
        "rewarder": {"host": "127.0.0.1", "port": port, "workers": 1, "grace_s": 1},
        "auth": {"tls": {"cert_file": str(pki / "server.pem"), "key_file": str(pki / "server.key"),
                         "ca_file": str(pki / "ca.pem"), "require_client_cert": True}},
    }))
    svc = service_factory("rewarder", ["--config", str(stack_yaml)], port=port, env={TOKEN_ENV: TOKEN})
    # `dgrpo up`'s poll: the stack's own certificate as client identity (no extendedKeyUsage: usable both ways).
    Stack(stack_yaml, tmp_path / "run", color=False).wait_serving(
        Service("rewarder", "rewarder", [], port=port, proc=svc.proc, log_path=svc.log_path), timeout=120)
    group = score_group("q1", "1+2?", ["\\boxed{3}", "\\boxed{4}"], {"answer": "3"})

    async def info(credentials: Credentials):
        async with auth.channel(svc.address, credentials) as channel:
            return await rewarder_pb2_grpc.RewarderStub(channel).Info(rewarder_pb2.RewarderInfoRequest(), timeout=5)

    async def scenario():
        client = RewardClient(svc.address, timeout_s=30, credentials=Credentials(TOKEN, _tls(pki, identity="client")))
        try:
            reward = await client.score(group)
        finally:
            await client.close()
        refused = {
            "plaintext": await _error(info(Credentials(TOKEN))),
            "no certificate": await _error(info(Credentials(TOKEN, _tls(pki)))),
            "trusts another CA": await _error(info(Credentials(TOKEN, _tls(pki, "other_ca", "client")))),
            "certificate from another CA": await _error(info(Credentials(TOKEN, _tls(pki, identity="stranger")))),
        }
        no_token = await _error(info(Credentials(None, _tls(pki, identity="client"))))
        return reward, refused, no_token

    reward, refused, no_token = asyncio.run(scenario())
    assert reward.rewards == [1.0, 0.0]
    for what, err in refused.items():
        assert err.code() == grpc.StatusCode.UNAVAILABLE, (what, err)  # the handshake fails: nothing is served
    assert no_token.code() == grpc.StatusCode.UNAUTHENTICATED  # TLS does not replace the token

    mutual = ["--ca-file", str(pki / "ca.pem"), "--cert-file", str(pki / "client.pem"), "--key-file",
              str(pki / "client.key")]
    served, plain, certless = _probe(port, *mutual), _probe(port), _probe(port, "--ca-file", str(pki / "ca.pem"))
    assert served.returncode == 0 and "SERVING" in served.stdout, served
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stdout
    assert certless.returncode == 1 and "UNAVAILABLE" in certless.stdout
    assert "PRIVATE KEY" not in svc.logs()


# ---- the learner's control server with server-only TLS, in process -----------------------------------------------


def test_control_server_with_tls_still_requires_the_token_and_health_answers_over_tls(child_processes, pki):
    cfg = load_config(StackConfig, None, [f"auth.tls.cert_file={pki / 'server.pem'}",
                                          f"auth.tls.key_file={pki / 'server.key'}"])
    server_credentials = Credentials(TOKEN, cfg.auth.tls.material())

    async def status(port: int, credentials: Credentials):
        async with auth.channel(f"localhost:{port}", credentials) as channel:
            return await learner_pb2_grpc.LearnerStub(channel).Status(learner_pb2.StatusRequest(), timeout=5)

    async def scenario():
        server = await start_control_server(LoopState(step=4), "127.0.0.1", 0, credentials=server_credentials)
        try:
            port = server.port
            served = await status(port, Credentials(TOKEN, _tls(pki)))  # no client certificate needed here
            no_token = await _error(status(port, Credentials(None, _tls(pki))))
            plaintext = await _error(status(port, Credentials(TOKEN)))
            other_ca = await _error(status(port, Credentials(TOKEN, _tls(pki, "other_ca"))))
            probes = await asyncio.gather(*(asyncio.to_thread(_probe, port, *flags) for flags in (
                ("--ca-file", str(pki / "ca.pem")), (), ("--ca-file", str(pki / "other_ca.pem")))))
        finally:
            await server.stop(0)
        return served, no_token, plaintext, other_ca, probes

    served, no_token, plaintext, other_ca, (tls_probe, plain_probe, wrong_ca_probe) = asyncio.run(scenario())
    assert served.step == 4
    assert no_token.code() == grpc.StatusCode.UNAUTHENTICATED
    assert plaintext.code() == other_ca.code() == grpc.StatusCode.UNAVAILABLE
    assert tls_probe.returncode == 0 and "SERVING" in tls_probe.stdout, tls_probe
    assert plain_probe.returncode == wrong_ca_probe.returncode == 1


# ---- settings checked at load ------------------------------------------------------------------------------------


def _load(pki: Path, **tls: object) -> StackConfig:
    return load_config(StackConfig, None, [f"auth.tls.{k}={v}" for k, v in tls.items()])


@pytest.mark.parametrize(("settings", "message"), [
    ({"cert_file": "missing.pem", "key_file": "server.key"}, r"auth\.tls\.cert_file='.*missing\.pem' cannot be read"),
    ({"key_file": "server.key"}, r"auth\.tls\.key_file is set without auth\.tls\.cert_file"),
    ({"ca_file": "ca.pem"}, r"auth\.tls\.ca_file is set but auth\.tls\.cert_file is not"),
    ({"cert_file": "server.pem", "key_file": "server.key", "require_client_cert": "true"},
     r"auth\.tls\.require_client_cert=true needs auth\.tls\.ca_file"),
    ({"cert_file": "server.pem", "key_file": "client.key"}, r"auth\.tls\.key_file='.*client\.key' is not the priv"),
    ({"cert_file": "server.key", "key_file": "server.key"}, r"auth\.tls\.cert_file='.*' holds no PEM certificate"),
    ({"cert_file": "server.pem", "key_file": "locked.key"}, r"auth\.tls\.key_file='.*locked\.key' is encrypted"),
    ({"cert_file": "server.pem", "key_file": "server.key", "ca_file": "server.key"},
     r"auth\.tls\.ca_file='.*' holds no PEM certificate"),
])
def test_unusable_tls_settings_fail_at_load_naming_the_key(pki, settings, message):
    settings = {k: (pki / v if k.endswith("_file") else v) for k, v in settings.items()}
    with pytest.raises(ConfigError, match=message) as err:
        _load(pki, **settings)
    key_lines = {line for name in ("server", "client", "locked") for line in
                 (pki / f"{name}.key").read_text().splitlines() if "-----" not in line}
    assert not any(line in str(err.value) for line in key_lines)  # paths only, never file contents


def test_no_tls_is_plaintext_and_the_private_key_never_shows(pki, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert AuthConfig().credentials() == Credentials(None, None)
    cfg = _load(pki, cert_file=pki / "server.pem", key_file=pki / "server.key", ca_file=pki / "ca.pem",
                server_name="rewarder")
    credentials = cfg.auth.credentials()
    key = (pki / "server.key").read_bytes()
    assert credentials.tls.private_key == key and credentials.tls.server_name == "rewarder"
    assert credentials.tls.channel_options() == [("grpc.ssl_target_name_override", "rewarder")]
    assert key.decode() not in repr(credentials) and "PRIVATE" not in repr(credentials)
    assert "PRIVATE" not in cfg.model_dump_json()  # stack.yaml and the learner's records hold only paths
