"""The session's real Prefect server runs flows and records them."""

import pytest

pytestmark = pytest.mark.prefect


def test_flow_run_is_recorded_on_the_real_server(prefect_server):
    from prefect import flow, get_client

    @flow(name="ckpt-smoke")
    def smoke(x: int) -> int:
        return x + 1

    assert smoke(41) == 42
    import asyncio

    async def count() -> int:
        async with get_client() as c:
            runs = await c.read_flow_runs()
            return sum(1 for r in runs if r.state and r.state.is_completed())

    assert asyncio.run(count()) >= 1
