"""The `auth` section: the shared bearer token's source and the TLS files, checked at load.

Schema only (the standard library and pydantic): the config validates before grpc is imported, and every service's
config imports it. What the checked files and token become, `Credentials`, is plain data here; common/auth.py turns
it into grpc credentials, interceptors and channels.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from dgrpo.common.config import ConfigError, StrictConfig

TOKEN_ENV = "DGRPO_TOKEN"
MIN_TOKEN_CHARS = 16


class TlsConfig(StrictConfig):
    """TLS on every gRPC server and client of the process (unset: plaintext). Files are PEM, read from disk."""

    cert_file: Path | None = None
    """PEM certificate (chain) this process presents: as a server, and as a client when a server asks for one
    (mutual TLS). Setting it (with key_file) turns TLS on for every gRPC server and client of the process. It must
    name the address clients dial in its subjectAltName (the DNS name, or 127.0.0.1 under `dgrpo up`), or the
    clients set server_name; with extendedKeyUsage, include both serverAuth and clientAuth."""
    key_file: Path | None = None
    """PEM private key of cert_file, unencrypted (keep it `chmod 600`). Read from disk, never logged."""
    ca_file: Path | None = None
    """PEM CA certificate(s) trusted: clients verify every server against them, and with require_client_cert
    servers verify every client. Unset: clients trust the system's roots (a public CA)."""
    require_client_cert: bool = False
    """Mutual TLS: servers refuse any connection (health included) whose client presents no certificate signed by
    ca_file. Any certificate from that CA is accepted, so give the run a CA of its own."""
    server_name: str | None = None
    """The name clients expect in every server's certificate instead of the host they dial (e.g. one certificate
    for all replicas, or a cert without the IP). Unset: the dialed host."""

    @model_validator(mode="after")
    def _usable(self) -> TlsConfig:
        self.material()  # unreadable or mismatched files fail at load, naming the key (ConfigError is a ValueError)
        return self

    def material(self) -> TlsMaterial | None:
        """The PEM bytes (None: TLS off); raises ConfigError naming the key of a missing, unreadable or unusable
        file, or of a setting that needs another one. Messages name paths only, never file contents."""
        if (self.cert_file is None) != (self.key_file is None):
            have, missing = ("cert_file", "key_file") if self.key_file is None else ("key_file", "cert_file")
            raise ConfigError(f"auth.tls.{have} is set without auth.tls.{missing}: a TLS server needs both its "
                              "certificate and its private key")
        if self.cert_file is None:
            extra = [k for k in ("ca_file", "server_name") if getattr(self, k) is not None]
            extra += ["require_client_cert"] if self.require_client_cert else []
            if extra:
                raise ConfigError(f"auth.tls.{extra[0]} is set but auth.tls.cert_file is not: TLS is on only with a "
                                  "certificate and key (every dgrpo service serves gRPC), and without it the "
                                  "channels would stay plaintext")
            return None
        if self.require_client_cert and self.ca_file is None:
            raise ConfigError("auth.tls.require_client_cert=true needs auth.tls.ca_file: the CA that signs the "
                              "clients' certificates")
        if self.server_name is not None and not self.server_name.strip():
            raise ConfigError("auth.tls.server_name is empty: leave it unset to expect the dialed host")
        cert, key = _read(self.cert_file, "cert_file"), _read(self.key_file, "key_file")
        ca = _read(self.ca_file, "ca_file") if self.ca_file is not None else None
        _check_pair(self.cert_file, cert, self.key_file, key)
        if ca is not None:
            _check_ca(self.ca_file, ca)
        return TlsMaterial(root_certificates=ca, certificate_chain=cert, private_key=key,
                           require_client_cert=self.require_client_cert, server_name=self.server_name)


def _read(path: Path, key: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"auth.tls.{key}={str(path)!r} cannot be read: {e.strerror}") from None


def _check_pair(cert_path: Path, cert: bytes, key_path: Path, key: bytes) -> None:
    """The stdlib's OpenSSL loads the pair as grpc will: a bad PEM or a key of another certificate fails here, at
    load, instead of at the first handshake with a bare "handshake failed"."""
    where_cert, where_key = f"auth.tls.cert_file={str(cert_path)!r}", f"auth.tls.key_file={str(key_path)!r}"
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise ConfigError(f"{where_cert} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    if b"PRIVATE KEY-----" not in key:
        raise ConfigError(f"{where_key} holds no PEM private key (-----BEGIN PRIVATE KEY-----)")
    if b"ENCRYPTED" in key:
        raise ConfigError(f"{where_key} is encrypted; grpc needs it unencrypted (e.g. `openssl pkey -in KEY -out "
                          "PLAIN`, then chmod 600)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path, password=_no_password)
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"{where_key} is not the private key of {where_cert}") from None
        raise ConfigError(f"{where_cert} with {where_key} cannot be loaded ({e.reason or 'not PEM'})") from None
    except (OSError, _Encrypted):
        raise ConfigError(f"{where_cert} with {where_key} cannot be loaded") from None


class _Encrypted(Exception):
    pass


def _no_password() -> bytes:
    raise _Encrypted  # never prompt on a terminal for a passphrase


def _check_ca(path: Path, ca: bytes) -> None:
    where = f"auth.tls.ca_file={str(path)!r}"
    if b"-----BEGIN CERTIFICATE-----" not in ca:
        raise ConfigError(f"{where} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"{where} cannot be loaded as CA certificates ({getattr(e, 'reason', None) or e})") from None


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes read once from auth.tls (kept out of repr: the private key never reaches a log or traceback)."""

    root_certificates: bytes | None = field(default=None, repr=False)
    """CA certificates; None: grpc's default roots (client side only)."""
    certificate_chain: bytes | None = field(default=None, repr=False)
    private_key: bytes | None = field(default=None, repr=False)
    require_client_cert: bool = False
    server_name: str | None = None

    def channel_options(self) -> list[tuple[str, Any]]:
        return [] if self.server_name is None else [("grpc.ssl_target_name_override", self.server_name)]


@dataclass(frozen=True)
class Credentials:
    """What servers and channels take: the token (None: none required or sent) and the TLS material (None:
    plaintext). Made once per process by `AuthConfig.credentials()`."""

    token: str | None = field(default=None, repr=False)
    tls: TlsMaterial | None = None


class AuthConfig(StrictConfig):
    """Authentication of every gRPC call between the services (a shared bearer token and optional TLS; unset:
    neither)."""

    token_file: Path | None = None
    """File holding the shared token (one line, at least 16 printable characters without spaces; e.g. the output
    of `python -c "import secrets; print(secrets.token_urlsafe(32))"`). Unset: the `DGRPO_TOKEN` environment
    variable, and with neither, no authentication. The token itself is never a config key."""
    tls: TlsConfig = Field(default_factory=TlsConfig)
    """TLS for every gRPC channel: certificates from files; mutual TLS with require_client_cert (docs/security.md).
    Unset: plaintext."""

    @model_validator(mode="before")
    @classmethod
    def _no_inline_token(cls, data: Any) -> Any:
        if isinstance(data, dict) and "token" in data:
            raise ValueError(
                "auth.token cannot be set in the config or on the command line (it would show in `ps`, shell "
                f"history, logs and stack.yaml): put the token in a file named by auth.token_file, or in {TOKEN_ENV}"
            )
        return data

    def token(self) -> str | None:
        """The configured token (from `token_file`, else `DGRPO_TOKEN`), or None for no authentication.

        Raises ConfigError for an unreadable file or an unusable token (the message never contains the token)."""
        if self.token_file is not None:
            try:
                text = self.token_file.read_text()
            except OSError as e:
                raise ConfigError(f"auth.token_file={str(self.token_file)!r} cannot be read: {e.strerror}") from None
            return _checked(text.strip(), f"the token in auth.token_file={str(self.token_file)!r}")
        text = os.environ.get(TOKEN_ENV, "").strip()
        return _checked(text, f"${TOKEN_ENV}") if text else None  # empty (compose's `${DGRPO_TOKEN:-}`): unset

    def credentials(self) -> Credentials:
        """The token and the TLS material, read once, for this process's servers and clients (ConfigError for
        unusable ones, naming the key, never the secret)."""
        return Credentials(token=self.token(), tls=self.tls.material())


def _checked(token: str, where: str) -> str:
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"{where} has {len(token)} characters; use at least {MIN_TOKEN_CHARS} (e.g. "
                          "python -c \"import secrets; print(secrets.token_urlsafe(32))\")")
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise ConfigError(f"{where} must be printable ASCII without spaces (it travels as gRPC metadata)")
    return token
