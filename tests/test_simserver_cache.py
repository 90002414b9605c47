"""The simulator's many-server mode (benchmarks/longtail/simserver.py): its KV cache (hits, LRU eviction, capacity),
and its servers driven over HTTP by the real SGLangBackend (cached_tokens in replies, queueing when KV is full,
/get_load)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import httpx2
import pytest
from aiohttp import web

from benchmarks.longtail.model import IM_END, IM_START
from benchmarks.longtail.simserver import BLOCK, Fleet, KVCache, SimConfig, chain
from engine.backends.base import SamplingParams
from engine.backends.sglang import SGLangBackend
from engine.errors import BackendError

PARAMS = SamplingParams(max_new_tokens=1024, stop_token_ids=(IM_END,))


def prompt(i: int, length: int) -> list[int]:
    """A chat-shaped prompt of `length` tokens ending in the assistant header."""
    body = [5000 + i * 1000 + k for k in range(length - 3)]
    return [*body, IM_START, 77091, 198]


def test_a_cached_prefix_is_found_and_held_blocks_are_never_evicted():
    cache = KVCache(capacity_tokens=10 * BLOCK)
    a = chain(list(range(4 * BLOCK)))
    lease = cache.allocate(a, 4 * BLOCK + 8)
    assert lease is not None and lease.prefix == [] and cache.num_used == 5  # 4 blocks and a half, rounded up
    cache.release(lease, a)
    assert cache.num_cached(a) == 4 and cache.num_used == 4 and len(cache.evictable) == 4
    # a longer prompt with the same start reuses those 4 blocks and needs 2 of its own
    b = chain(list(range(6 * BLOCK)))
    lease_b = cache.allocate(b, 6 * BLOCK)
    assert lease_b is not None and lease_b.prefix == a and lease_b.num_private == 2
    assert not cache.evictable  # all held now
    # 6 used of 10: a request needing 5 does not fit, as nothing may be evicted
    assert cache.allocate(chain(list(range(1000, 1000 + 5 * BLOCK))), 5 * BLOCK) is None


def test_eviction_is_least_recently_used_and_deepest_first():
    cache = KVCache(capacity_tokens=6 * BLOCK)
    old, new = chain(list(range(3 * BLOCK))), chain(list(range(500, 500 + 3 * BLOCK)))
    for hashes in (old, new):
        cache.release(cache.allocate(hashes, 3 * BLOCK), hashes)
    assert cache.num_cached(old) == 3 and cache.num_cached(new) == 3
    # 2 more blocks: the 2 deepest of the least recent session go, its first block stays matchable
    third = chain(list(range(900, 900 + 2 * BLOCK)))
    assert cache.allocate(third, 2 * BLOCK) is not None
    assert cache.num_cached(old) == 1 and cache.num_cached(new) == 3 and cache.num_evicted == 2


@contextlib.asynccontextmanager
async def fleet(**overrides) -> AsyncIterator[tuple[Fleet, str]]:
    config = SimConfig(**{
        "servers": 2, "kv_tokens": 4096, "max_running": 8, "median_tokens": 20.0, "sigma": 0.0,
        "decode_a": 0.001, "decode_b": 0.0, "prefill_s_per_token": 0.0, **overrides,
    })  # fmt: skip
    sim = Fleet(config)
    runner = web.AppRunner(sim.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield sim, f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.mark.anyio
async def test_a_second_turn_on_the_same_server_is_cached_and_on_another_is_not():
    async with fleet() as (sim, url):
        async with SGLangBackend(f"{url}/s/0") as zero, SGLangBackend(f"{url}/s/1") as one:
            assert zero.is_router is False  # each path prefix is one server
            first_prompt = prompt(0, 200)
            first = await zero.generate(first_prompt, PARAMS)
            assert first.finish_reason == "stop" and len(first.token_ids) == 20 and first.cached_tokens == 0
            second_prompt = [
                *first_prompt,
                *first.token_ids,
                198,
                IM_START,
                872,
                *range(7000, 7040),
                IM_START,
                77091,
                198,
            ]
            again = await zero.generate(second_prompt, PARAMS)
            # every full block of the first turn (prompt and output, 220 tokens) is reused
            assert again.cached_tokens == (220 // BLOCK) * BLOCK and again.prompt_tokens == len(second_prompt)
            elsewhere = await one.generate(second_prompt, PARAMS)
            # one model for all servers: the same prefix sent again is its next sample, not a repeat
            assert elsewhere.cached_tokens == 0 and elsewhere.token_ids != again.token_ids
        async with httpx2.AsyncClient(base_url=url) as client:
            stats = (await client.get("/stats")).json()
    assert stats["servers"] == 2 and stats["num_requests"] == 3
    assert stats["cached_tokens"] == 208 and stats["prefill_tokens"] == 200 + (len(second_prompt) - 208) + len(
        second_prompt
    )


@pytest.mark.anyio
async def test_requests_wait_while_the_kv_cache_is_full_and_get_load_says_so():
    # room for 2 requests of 1,000-token prompts (and their 20 tokens) in 2,048 tokens: the third waits
    async with fleet(kv_tokens=2048, decode_a=0.01) as (sim, url):
        server = sim.servers[0]
        async with SGLangBackend(f"{url}/s/0") as backend, httpx2.AsyncClient(base_url=url) as client:
            results = {}

            async def run(i: int) -> None:
                results[i] = await backend.generate(prompt(i, 1000), PARAMS)

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(run, i)
                with anyio.fail_after(5):
                    while len(server.running) + len(server.waiting) < 3:
                        await anyio.sleep(0.001)
                [load] = (await client.get("/s/0/get_load")).json()
                assert load["num_reqs"] == 2 and load["num_waiting_reqs"] == 1
                assert 2000 <= load["num_tokens"] <= 2048
            stats = (await client.get("/stats")).json()
    assert all(r.finish_reason == "stop" and len(r.token_ids) == 20 for r in results.values())
    # the third ran after one of the first two ended: it started 20 steps (0.2 s) later
    latencies = sorted(r.meta["e2e_latency"] for r in results.values())
    waited = latencies[2] - latencies[0]
    assert waited >= 0.15
    # it waited with 6 of the 8 slots free: for KV room, not for a slot
    assert stats["waiting_seconds"] == pytest.approx(waited, abs=0.05)
    assert stats["blocked_slot_seconds"] == pytest.approx(6 * waited, abs=0.3)
    assert stats["kv_blocked_share"] > 0


@pytest.mark.anyio
async def test_a_request_waiting_for_a_slot_is_not_counted_as_blocked_by_kv():
    async with (
        fleet(max_running=1, decode_a=0.01) as (_, url),
        SGLangBackend(f"{url}/s/0") as backend,
        httpx2.AsyncClient(base_url=url) as client,
    ):
        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(backend.generate, prompt(i, 100), PARAMS)
        stats = (await client.get("/stats")).json()
    # one ran 20 steps (0.2 s) while the other waited for the one slot, with KV room to spare
    assert stats["waiting_seconds"] >= 0.15
    assert stats["blocked_slot_seconds"] == 0 and stats["kv_blocked_share"] == 0


@pytest.mark.anyio
async def test_an_abort_returns_what_was_generated_and_a_weight_update_empties_the_cache():
    async with fleet(decode_a=0.05) as (sim, url):  # 20 tokens in 1 s: an abort after 5 lands mid-way
        async with SGLangBackend(f"{url}/s/1") as backend:
            params = SamplingParams(max_new_tokens=1024)
            results = {}

            async def run() -> None:
                results["r"] = await backend.generate(prompt(3, 64), params, rid="r")

            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                with anyio.fail_after(5):
                    while sim.servers[1].progress() < 5:
                        await anyio.sleep(0.002)
                await backend.abort("r")
            aborted = results["r"]
            assert aborted.finish_reason == "abort" and 1 <= len(aborted.token_ids) < 20
            resumed = await backend.generate([*prompt(3, 64), *aborted.token_ids], params)
            # the prompt and the tokens generated before the abort are cached, in whole blocks
            assert resumed.cached_tokens == (64 + len(aborted.token_ids)) // BLOCK * BLOCK
            assert len(aborted.token_ids) + len(resumed.token_ids) == 20
            await backend.update_weights_from_disk("/sim/weights", weight_version="v1")
            fresh = await backend.generate(prompt(3, 64), params)
            assert fresh.cached_tokens == 0 and fresh.weight_version == "v1"
        async with httpx2.AsyncClient(base_url=url) as client:
            assert (await client.get("/s/2/get_load")).status_code == 404  # two servers: 0 and 1


@pytest.mark.anyio
async def test_a_pause_in_place_holds_requests_until_resume_and_retract_is_refused():
    async with fleet(decode_a=0.002) as (sim, url):
        server = sim.servers[0]
        async with SGLangBackend(f"{url}/s/0") as backend:
            results = {}

            async def run() -> None:
                results["r"] = await backend.generate(prompt(5, 64), PARAMS)

            async with anyio.create_task_group() as tg:
                await backend.pause("in_place")
                tg.start_soon(run)
                with anyio.fail_after(5):
                    while not server.waiting:
                        await anyio.sleep(0.001)
                assert server.progress() == 0 and "r" not in results  # queued, nothing generated while paused
                await backend.resume()
            assert results["r"].finish_reason == "stop" and len(results["r"].token_ids) == 20
            with pytest.raises(BackendError, match="pause mode 'retract' is not simulated with many servers"):
                await backend.pause("retract")
