"""Work the API server runs in its preprocessing pool: an exception of any kind reaches the request."""
import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from minillm.server.serving import ServingContext


def test_a_stop_iteration_in_the_pool_fails_the_request_instead_of_never_answering_it():
    # asyncio cannot set a StopIteration on a Future (TypeError inside the executor's callback): the
    # awaiting request was never answered (a /v1/messages/count_tokens body past 64 KiB did that).
    def stops():
        return next(iter(()))

    async def call():
        with ThreadPoolExecutor(1) as pool:
            return await asyncio.wait_for(ServingContext.run_blocking(SimpleNamespace(executor=pool), stops), 30)

    with pytest.raises(RuntimeError, match="StopIteration in .*stops"):
        asyncio.run(call())
