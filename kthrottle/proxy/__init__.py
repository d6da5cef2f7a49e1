"""The proxy's I/O: listeners, per-connection pipelines, upstream connections."""
from .server import ProxyServer

__all__ = ["ProxyServer"]
