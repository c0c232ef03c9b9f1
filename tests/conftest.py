from __future__ import annotations

import pytest_asyncio

from tests.stack import start_stack


@pytest_asyncio.fixture
async def stack():
    """Identical draft and target (acceptance 1)."""
    s = await start_stack()
    yield s
    await s.close()


@pytest_asyncio.fixture
async def disagreeing_stack():
    """Draft that disagrees often with the target (acceptance ~0.25)."""
    s = await start_stack(draft_ref="tiny:seed=0,noise=0.04")
    yield s
    await s.close()
