"""Engines of your own behind the daemon (docs/engines.md): subclass `Engine`, override the methods for the
requests it serves, and call `serve(YourEngine())` as the process a lane's `worker_command` starts. The server
speaks protocol v3 for it: HELLO and the nonce, framing, PROGRESS, CANCEL, SHUTDOWN and the extensions the class
implements."""

from .._errors import WorkerError
from ._api import (
    Context,
    EmbedRequest,
    GenerateRequest,
    Generation,
    LoadRequest,
    Ranking,
    RerankRequest,
    UnloadRequest,
)
from ._base import Engine
from ._serve import serve

__all__ = [
    "Context",
    "EmbedRequest",
    "Engine",
    "GenerateRequest",
    "Generation",
    "LoadRequest",
    "Ranking",
    "RerankRequest",
    "UnloadRequest",
    "WorkerError",
    "serve",
]
