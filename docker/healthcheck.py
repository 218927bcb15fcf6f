"""The image's HEALTHCHECK: GET /health on the port the server (PID 1) listens on.

The port is read from the server's own command line, where docker/entrypoint.sh put
PAGEDLLM_PORT and where a `--port` after the image name overrides it (the last one wins, as in
argparse); PAGEDLLM_PORT alone would miss that override.
"""

import os
import sys
import urllib.request


def server_port(argv: list[str], default: str) -> str:
    """The last ``--port N`` or ``--port=N`` in ``argv``, else ``default``."""
    port = default
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            port = argv[i + 1]
        elif arg.startswith("--port="):
            port = arg.split("=", 1)[1]
    return port


def main() -> int:
    with open("/proc/1/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\0")
    port = server_port(argv, os.environ.get("PAGEDLLM_PORT", "8000"))
    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
