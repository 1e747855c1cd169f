"""One API server process of `asyncengine serve --api-server-count K`.

`python -m asyncengine.entrypoints.openai.api_server_proc`, started by the
APIServerProcessManager with an `APIServerLaunch` on its stdin: the OpenAI app over an
AsyncLLM that is client `client_index` of engine cores the manager started, serving on the
listening socket the manager bound and handed down (every API server accepts on it). SIGTERM
drains it (a second SIGTERM aborts what is left at once); SIGINT is ignored, left to the
manager (a terminal's Ctrl-C reaches the whole process group); its parent's death stops it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket

import msgspec

from asyncengine.child_process import read_payload
from asyncengine.config import EngineConfig
from asyncengine.process_setup import ignore_sigint_from_now

logger = logging.getLogger(__name__)


class CoreEndpoint(msgspec.Struct, gc=False):
    """A running engine core, as its clients reach it."""

    input_address: str
    pid: int
    num_kv_blocks: int


class ServerOptions(msgspec.Struct, gc=False):
    """`serve`'s options of the HTTP server (the same for every API server process)."""

    served_model_name: str
    api_key: str | None
    max_request_body_bytes: int
    allowed_hosts: list[str] | None
    shutdown_timeout: float
    log_level: str
    access_log: bool
    host: str
    port: int
    reasoning_parser: str | None = None
    lora_modules: dict[str, str] = {}  # serve --lora-modules: each API server adds them
    enable_lora_runtime_updates: bool = False


class APIServerLaunch(msgspec.Struct, gc=False):
    """Manager → API server process, on its stdin at start."""

    config: EngineConfig
    client_index: int
    output_address: str  # this process binds it; every core sends its outputs there
    cores: list[CoreEndpoint]  # by data-parallel rank
    listen_fd: int  # the manager's listening socket, inherited
    metrics_dir: str  # where each API server shares its metrics (see metrics.py)
    options: ServerOptions


def main() -> None:
    ignore_sigint_from_now()  # first: the process started with SIGINT blocked
    launch = msgspec.msgpack.decode(read_payload(), type=APIServerLaunch)
    _start_parent_watch()
    serve(launch)


def serve(launch: APIServerLaunch) -> None:
    from asyncengine.client.async_llm import AsyncLLM
    from asyncengine.client.cores.attached import AttachedCores, RunningCore
    from asyncengine.client.cores.proc_client import ProcCoreClient
    from asyncengine.entrypoints.openai.app import build_app
    from asyncengine.entrypoints.openai.server import make_server

    config, options = launch.config, launch.options
    cores = [
        RunningCore(f"engine core rank {rank}", c.input_address, c.pid, c.num_kv_blocks)
        for rank, c in enumerate(launch.cores)
    ]
    client = ProcCoreClient(
        config,
        startup_timeout=60.0,
        backend=AttachedCores(cores, launch.output_address),
        client_index=launch.client_index,
    )
    engine = AsyncLLM(config, core_client=client)
    app = build_app(
        engine,
        served_model_name=options.served_model_name,
        api_key=options.api_key,
        max_request_body_bytes=options.max_request_body_bytes,
        allowed_hosts=options.allowed_hosts,
        metrics_dir=launch.metrics_dir,
        api_server_index=launch.client_index,
        reasoning_parser=options.reasoning_parser,
        lora_modules=options.lora_modules,
        enable_lora_runtime_updates=options.enable_lora_runtime_updates,
    )
    server = make_server(
        app,
        host=options.host,
        port=options.port,
        drain_timeout=options.shutdown_timeout,
        log_level=options.log_level,
        access_log=options.access_log,
        handle_sigint=False,
    )
    sock = socket.socket(fileno=launch.listen_fd)
    server.run_owning_engine(sockets=[sock])


def _start_parent_watch() -> None:
    from asyncengine.process_setup import start_parent_watch

    def on_death() -> None:
        logger.warning("the API server's manager died: shutting down")
        os.kill(os.getpid(), signal.SIGTERM)  # a drain; the manager's cores are going too

    start_parent_watch(on_death, "APIServerParentWatch")


if __name__ == "__main__":
    main()
