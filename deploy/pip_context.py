"""The host's pip configuration, made usable inside `docker build` without entering any image layer.

deploy/build.sh runs `python3 deploy/pip_context.py DIR` in the background for the length of a build. It reads
the host's effective pip settings (`pip config list`, which includes PIP_* variables) and writes:

- DIR/pip.conf: the same settings for pip inside the build (given as the BuildKit secret `pip.conf`): the CA
  bundle becomes the secret `pip-cert` (/run/secrets/pip-cert), and every local folder (find-links, file://
  indexes, constraint files) is served over HTTP on the host's 127.0.0.1 by this process (the build runs with
  --network=host), because those paths do not exist inside a container;
- DIR/cert: the host path of the CA bundle, or nothing;
- DIR/ready: written last, once the server listens.

Only stdlib: it runs with whatever python3 the host has. Nothing it serves or writes is copied into an image: the
secrets are mounted per RUN, and the loopback server is gone when the build ends.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

# pip's options that take several values (merged over scopes); every other one is a scalar.
LISTS = {"extra-index-url", "find-links", "trusted-host", "constraint"}
# Later scopes win for scalars (pip: global < site < user < environment); lists are merged.
SCOPE_ORDER = {"global": 0, "site": 1, "user": 2, ":env:": 3}


def host_settings() -> dict[str, list[str]]:
    """{option: values} of the host's effective pip configuration, `cert` included."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found: list[tuple[int, str, str]] = []
    for line in out.splitlines():
        m = re.match(r"^([^.=]*)\.([\w-]+)='(.*)'$", line.strip())
        if m:
            scope, key, value = m.groups()
            found.append((SCOPE_ORDER.get(scope, 0), key, value))
    settings: dict[str, list[str]] = {}
    for _, key, value in sorted(found, key=lambda f: f[0]):
        values = value.split()
        if key in LISTS:
            settings.setdefault(key, [])
            settings[key] += [v for v in values if v not in settings[key]]
        else:
            settings[key] = values
    return settings


def container_config(settings: dict[str, list[str]], serve: Path, port: int) -> tuple[str, str | None]:
    """(pip.conf text for inside the build, host CA bundle path); local folders are linked under `serve`."""
    base = f"http://127.0.0.1:{port}"
    counter = iter(range(10_000))

    def publish(path: Path) -> str:
        name = f"p{next(counter)}"
        (serve / name).symlink_to(path.resolve())
        return f"{base}/{name}"

    lines = ["[global]"]
    cert = next(iter(settings.get("cert", [])), None)
    if cert and Path(cert).is_file():
        lines.append("cert = /run/secrets/pip-cert")
    else:
        cert = None
    def index(url: str) -> str | None:
        parsed = urlparse(url)
        if parsed.scheme != "file":
            return url
        local = Path(parsed.path)  # served from its parent: an index's pages may link to ../../files/...
        return f"{publish(local.parent)}/{local.name}/" if local.is_dir() else None

    for key in ("timeout", "default-timeout", "retries"):
        if key in settings:
            lines.append(f"{key} = {settings[key][0]}")
    if settings.get("index-url") and index(settings["index-url"][0]):
        lines.append(f"index-url = {index(settings['index-url'][0])}")
    indexes, links, constraints = [], [], []
    indexes = [u for u in map(index, settings.get("extra-index-url", [])) if u]
    for link in settings.get("find-links", []):
        local = Path(urlparse(link).path if link.startswith("file:") else link)
        if "://" in link and not link.startswith("file:"):
            links.append(link)
        elif local.is_dir():
            links.append(publish(local) + "/")
    for c in settings.get("constraint", []):
        if Path(c).is_file():
            links_dir = serve / f"c{len(constraints)}"
            links_dir.mkdir()
            shutil.copy(c, links_dir / Path(c).name)
            constraints.append(f"{base}/{links_dir.name}/{Path(c).name}")
    if indexes:
        lines.append("extra-index-url = " + " ".join(indexes))
    if links:
        lines.append("find-links = " + " ".join(links))
    if constraints:
        lines.append("constraint = " + " ".join(constraints))
    trusted = ["127.0.0.1", *settings.get("trusted-host", [])]
    lines.append("trusted-host = " + " ".join(dict.fromkeys(trusted)))
    return "\n".join(lines) + "\n", cert


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: pip_context.py DIR   (serves until killed; DIR/ready once listening)", file=sys.stderr)
        return 2
    out = Path(argv[0])
    serve = out / "serve"
    serve.mkdir(parents=True, exist_ok=True)
    handler = functools.partial(_QuietHandler, directory=str(serve))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    text, cert = container_config(host_settings(), serve, server.server_address[1])
    (out / "pip.conf").write_text(text)
    (out / "cert").write_text(cert or "")
    (out / "ready").write_text(str(os.getpid()))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # the stdlib handler logs every request to stderr
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
