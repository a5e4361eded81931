"""`python -m dgrpo.cli.token PATH`: make sure PATH holds the stack's gRPC token, so that no stack starts without one.

Compose runs it once before any service (deploy/docker-compose.yml, service `token`), writing into a volume that
every service mounts read-only and names with `auth.token_file`:
- DGRPO_TOKEN set: that token (checked as every service checks it), so an operator can choose it;
- else a token already in PATH (an earlier start of the same stack): kept, so clients holding it keep working;
- else a fresh one (`secrets.token_urlsafe(32)`).
The file is written whole and owner-only (0600), then renamed into place; the token is never printed.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from dgrpo.common.auth_config import TOKEN_ENV, AuthConfig
from dgrpo.common.config import ConfigError


def ensure_token(path: Path) -> str:
    """Where the token came from: 'given', 'kept' or 'generated' (ConfigError for a token that would be refused)."""
    given = os.environ.get(TOKEN_ENV, "").strip()
    if given:
        AuthConfig().token()  # the same check every service makes of DGRPO_TOKEN
        token, source = given, "given"
    elif path.is_file() and path.read_text().strip():
        AuthConfig(token_file=path).token()
        return "kept"
    else:
        token, source = secrets.token_urlsafe(32), "generated"
    write_token(path, token)
    return source


def write_token(path: Path, token: str) -> None:
    """`token` into `path`, owner-only from the first byte, and whole: a reader never sees a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(tmp, 0o600)  # an existing file keeps its old mode through O_CREAT
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dgrpo.cli.token PATH", file=sys.stderr)
        return 2
    try:
        source = ensure_token(Path(args[0]))
    except ConfigError as e:
        print(f"dgrpo token: {e}", file=sys.stderr)
        return 2
    print(f"dgrpo token: {args[0]}: {source} (read it with `cat {args[0]}` inside any dgrpo container)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
