"""Runs in vLLM's environment as the API server of `backstream vllm serve`
(`python -m backstream.rl.backends.vllm.launch ARGS`, the package's folder on PYTHONPATH): vLLM's OpenAI
server with its API key guarding every route but /health. Imports nothing of backstream.

vLLM's `--api-key` (or VLLM_API_KEY) guards only the paths under /v1, /v2, /inference and /cohere
(vllm 0.32.0, entrypoints/serve/middleware/authenticate.py `GUARDED_PREFIX`): the dev routes a run
publishes its weights through (/collective_rpc, /pause, /resume, /reset_prefix_cache) and
/server_info answered anyone who reached the port, key or not (checked). So the middleware is made to
guard every path; /health stays open for probes (it tells nothing and changes nothing)."""

from __future__ import annotations

import runpy

OPEN = ("/health",)  # the paths answered without the key


def guard_every_route() -> None:
    """Make vLLM's API-key middleware (installed when a key is set) guard every path but `OPEN`. A vLLM
    without that middleware stops here: serving its dev routes unguarded is what this prevents."""
    try:
        from vllm.entrypoints.serve.middleware import authenticate  # noqa: PLC0415
        middleware = authenticate.AuthenticationMiddleware
        authenticate.GUARDED_PREFIX  # the name the middleware matches paths against
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"backstream vllm serve: this vLLM's API-key middleware is not vllm 0.32.0's ({e}); its "
                         "dev routes could not be guarded") from None
    call = middleware.__call__

    def guarded(self, scope, receive, send):
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if path in OPEN:
            return self.app(scope, receive, send)
        return call(self, scope, receive, send)

    authenticate.GUARDED_PREFIX = ("/",)
    middleware.__call__ = guarded


if __name__ == "__main__":
    guard_every_route()
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
