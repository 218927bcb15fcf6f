"""The image's HEALTHCHECK: GET /health on the address and port the server (PID 1) listens on.

Both are read from the server's own command line, where docker/entrypoint.sh put PAGEDLLM_HOST
and PAGEDLLM_PORT and where a `--host` / `--port` after the image name overrides them (the last
one wins, as in argparse); the variables alone would miss that override. A server on a wildcard
address (0.0.0.0, ::) is reached on loopback; one bound to a single address only there.
"""

import os
import sys
import urllib.request


def last_flag(argv: list[str], flag: str, default: str) -> str:
    """The value of the last ``FLAG V`` or ``FLAG=V`` in ``argv``, else ``default``."""
    value = default
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def server_port(argv: list[str], default: str) -> str:
    """The last ``--port N`` or ``--port=N`` in ``argv``, else ``default``."""
    return last_flag(argv, "--port", default)


def health_url(argv: list[str], default_host: str, default_port: str) -> str:
    """The server's /health URL: its ``--host`` (loopback for a wildcard one) and ``--port``."""
    host = last_flag(argv, "--host", default_host)
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:  # an IPv6 address goes in brackets
        host = f"[{host}]"
    return f"http://{host}:{server_port(argv, default_port)}/health"


def main() -> int:
    with open("/proc/1/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\0")
    url = health_url(argv, os.environ.get("PAGEDLLM_HOST", "0.0.0.0"), os.environ.get("PAGEDLLM_PORT", "8000"))
    urllib.request.urlopen(url, timeout=4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
