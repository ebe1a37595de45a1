"""A bare byte pipe on uvloop: the floor under any Python pass-through's cost.

NOT A PROXY: no HTTP at all. Each client connection gets its own connection to the upstream
and every read is written to the other side as it is (keep-alive requests and their
responses pass through in order). What a Python process on uvloop spends to move the same
bytes with nothing else done: the part of the sidecar's cost that is the event loop and the
system calls. `bench_replay.py --floor` runs it as a path beside the sidecar and Envoy.

    python -m tests.bench.passthrough.floor --port 9400 --upstream 9100
"""

from __future__ import annotations

import argparse
import asyncio


class Upstream(asyncio.Protocol):
    def __init__(self, client: Client) -> None:
        self.client = client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.client.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.transport.close()


class Client(asyncio.Protocol):
    upstream_port = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.upstream: Upstream | None = None
        self.waiting: list[bytes] = []
        asyncio.get_running_loop().create_task(self.connect())

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(
                lambda: Upstream(self), "127.0.0.1", self.upstream_port
            )
        except OSError:
            self.transport.close()
            return
        self.upstream = upstream
        for data in self.waiting:
            upstream.transport.write(data)
        self.waiting.clear()

    def data_received(self, data: bytes) -> None:
        if self.upstream is None:
            self.waiting.append(data)
        else:
            self.upstream.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:
            self.upstream.transport.close()


async def serve(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Client, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", type=int, required=True)
    args = parser.parse_args()
    Client.upstream_port = args.upstream
    import uvloop  # a vLLM dependency, in the test venv

    uvloop.run(serve(args.port))


if __name__ == "__main__":
    main()
