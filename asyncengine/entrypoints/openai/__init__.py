"""An OpenAI-compatible HTTP server over AsyncLLM (Starlette; `asyncengine serve` runs it
under uvicorn). Needs the `serve` extra: `pip install starlette uvicorn`.

    from asyncengine.entrypoints.openai import build_app
    app = build_app("path/to/model", max_num_seqs=64)   # any ASGI server can run `app`
"""

from asyncengine.entrypoints.openai.app import build_app, server_state

__all__ = ["build_app", "server_state"]
