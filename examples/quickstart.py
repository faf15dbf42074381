"""Run Python in a stateful IPython kernel served by a Jupyter Kernel Gateway."""

import asyncio

from ipybox.kernel_mgr.client import KernelClient
from ipybox.kernel_mgr.server import KernelGateway


async def main() -> None:
    async with KernelGateway(port=None) as gateway, KernelClient(port=gateway.port) as client:
        await client.execute("squares = [n * n for n in range(10)]")
        result = await client.execute("print(sum(squares))")
        print(f"sum of squares: {result.text}")


if __name__ == "__main__":
    asyncio.run(main())
