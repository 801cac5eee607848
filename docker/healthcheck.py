"""Container health check: exit 0 if kvserve's /health answers 200, else 1.

The images run this as their HEALTHCHECK (and compose.yaml as its
healthcheck), with Python because the slim and CUDA base images have no curl.
It follows KVSERVE_PORT and KVSERVE_HOST, so an address changed by those
variables is still checked; one changed with --port/--host on the command
line is not (use the variables).
"""

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("KVSERVE_PORT") or "8000"
    host = os.environ.get("KVSERVE_HOST") or "127.0.0.1"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # bound to all: ask over loopback
    if ":" in host:
        host = f"[{host}]"
    request = urllib.request.Request(f"http://{host}:{port}/health")
    api_key = (
        (os.environ.get("KVSERVE_API_KEY") or "").split(",")[0].strip()
    )  # the first of its keys
    if api_key:  # in case /health sits behind the key
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError, ValueError) as exc:  # HTTPError (503) is a URLError
        print(f"kvserve {request.full_url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
