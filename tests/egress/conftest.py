"""The fixtures of `loopbed` (a real SOCKS5 server, TCP servers on loopback)."""

from loopbed import microsocks, tcp_server

__all__ = ["microsocks", "tcp_server"]
