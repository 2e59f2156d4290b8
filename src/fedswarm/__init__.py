"""fedswarm: a decentralized peer-to-peer compute federation.

The names a program needs are importable from here::

    import trio
    from fedswarm import JobRequest, open_swarm_client

    async def main() -> None:
        async with open_swarm_client(["/ip4/127.0.0.1/tcp/4001/p2p/12D3Koo..."]) as client:
            outputs = await client.run(JobRequest("tensor-map", shards=8), timeout=60)

    trio.run(main)

* the client library (trio): ``open_swarm_client``, ``open_client``,
  ``Client``, ``JobHandle``, ``ShardOutput``, and ``BlockingClient`` for
  scripts; a job is a ``JobRequest``; a tenant's key is an ``Identity``;
* the errors: ``FederationError`` and everything below it;
* serving: ``serve_peer`` with ``PeerOptions`` runs a peer (what
  ``peer start`` runs); ``start_block_server`` serves a span of an LLM's
  blocks and ``SwarmLLM`` generates through such spans.

Everything but the errors is imported on first use (``__getattr__``), so that
``import fedswarm`` -- and with it ``peer --help`` or a mistyped option --
does not pay for torch, py-libp2p or trio. Other modules (``fedswarm.core``,
``fedswarm.net``, ...) are public by their own ``__all__``; this list is the
short one.
"""

# no other top-level name than __all__'s, the submodules and dunders (see
# tests/test_public_api.py): helpers come in under a private alias
import importlib as _importlib
import typing as _typing

from . import errors as _errors
from .errors import *  # noqa: F403 (its __all__: the error hierarchy)

if _typing.TYPE_CHECKING:  # what __getattr__ imports, for type checkers and editors
    from .client import BlockingClient, Client, JobHandle, ShardOutput, open_client, open_swarm_client
    from .core.events import JobRequest
    from .core.identity import Identity
    from .daemon import PeerOptions, serve_peer
    from .llm_client import NoRoute, SwarmLLM
    from .llm_serving import start_block_server

#: public name -> the module that defines it (imported on first access)
_LAZY: dict[str, str] = {
    "open_swarm_client": "fedswarm.client",
    "open_client": "fedswarm.client",
    "Client": "fedswarm.client",
    "JobHandle": "fedswarm.client",
    "ShardOutput": "fedswarm.client",
    "BlockingClient": "fedswarm.client",
    "JobRequest": "fedswarm.core.events",
    "Identity": "fedswarm.core.identity",
    "serve_peer": "fedswarm.daemon",
    "PeerOptions": "fedswarm.daemon",
    "start_block_server": "fedswarm.llm_serving",
    "SwarmLLM": "fedswarm.llm_client",
    "NoRoute": "fedswarm.llm_client",
}

__all__ = [
    # client library
    "open_swarm_client",
    "open_client",
    "Client",
    "JobHandle",
    "ShardOutput",
    "BlockingClient",
    "JobRequest",
    "Identity",
    # serving
    "serve_peer",
    "PeerOptions",
    "start_block_server",
    "SwarmLLM",
    # the LLM client's error; the others (FederationError and below) follow
    "NoRoute",
]
__all__ += _errors.__all__


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fedswarm' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
