from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from ipybox.kernel_mgr.client import KernelClient
from ipybox.kernel_mgr.server import KernelGateway


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway() -> AsyncIterator[KernelGateway]:
    async with KernelGateway(port=None, env={"IPYBOX_TEST_VAR": "test-value"}) as gw:
        yield gw


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(
    gateway: KernelGateway, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[KernelClient]:
    images = tmp_path_factory.mktemp("images")
    async with KernelClient(port=gateway.port, images_dir=images) as c:
        yield c
