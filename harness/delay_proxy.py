"""A TCP proxy on the loopback that holds every reply a fixed time, as a Redis on another host
would (``python -m harness.delay_proxy TARGET_PORT DELAY_US``: prints its port, serves until
killed). One asyncio loop: requests pass at once, each chunk of a reply is written
``DELAY_US`` after it came, in order.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import dataclass


async def _serve(target_port: int, delay_s: float) -> None:
    loop = asyncio.get_running_loop()

    async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, delay: float) -> None:
        try:
            while data := await source.read(1 << 16):
                if delay:
                    loop.call_later(delay, sink.write, data)
                else:
                    sink.write(data)
        except ConnectionError:
            pass
        finally:
            await asyncio.sleep(delay)  # the replies still held go first
            sink.close()

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer, 0.0), pipe(up_reader, writer, delay_s))

    server = await asyncio.start_server(accepted, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


@dataclass
class DelayProxy:
    """A running proxy process in front of ``127.0.0.1:target_port``."""

    process: subprocess.Popen
    port: int

    @classmethod
    def start(cls, target_port: int, delay_us: int) -> DelayProxy:
        process = subprocess.Popen(
            [sys.executable, "-m", "harness.delay_proxy", str(target_port), str(delay_us)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        return cls(process, int(process.stdout.readline()))

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


if __name__ == "__main__":
    asyncio.run(_serve(int(sys.argv[1]), int(sys.argv[2]) / 1e6))
