"""`loraplex bench serve --url` (or `--http-compare`): the workload against a server, as streaming
completions over HTTP (httpx), one connection pool shared by all in-flight requests.

The client parses only the chunks it needs (the first one, and the usage chunk at the end), so that
at hundreds of streams the client's own process is not what limits the rate it measures."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from loraplex.bench.serve_metrics import RequestTiming, summarize
from loraplex.bench.serve_model import prompt_ids
from loraplex.bench.workloads import Workload, WorkloadRequest

_SAFE_VOCAB = 99  # token ids below this exist in every vocabulary (the demo's has 99)


async def _models(client: Any) -> tuple[str, list[str]]:  # noqa: ANN401
    listing = (await client.get("/v1/models")).raise_for_status().json()["data"]
    base = next(m["id"] for m in listing if m.get("parent") is None)
    return base, [m["id"] for m in listing if m.get("parent") is not None]


async def _one(
    client: Any,  # noqa: ANN401
    req: WorkloadRequest,
    model: str,
    timing: RequestTiming,
    start: float,
    seed: int,
    vocab: int,
) -> None:
    prompt: str | list[int] = req.prompt or prompt_ids(req, vocab, seed)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timing.admitted_s = time.perf_counter() - start
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(
                f"request {req.index}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            )
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if timing.first_token_s is not None and '"usage"' not in line:
                continue  # a token chunk after the first: nothing in it is measured
            chunk = json.loads(line[6:])
            if chunk.get("choices") and timing.first_token_s is None:
                timing.first_token_s = time.perf_counter() - start
            if chunk.get("usage"):
                timing.output_tokens = chunk["usage"]["completion_tokens"]
                timing.prompt_tokens = chunk["usage"]["prompt_tokens"]
    timing.finish_s = time.perf_counter() - start


async def _run(
    url: str,
    workload: Workload,
    api_key: str | None,
    progress: bool,
    names: list[str] | None,
    vocab: int,
) -> dict[str, Any]:
    import httpx
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    concurrency = workload.concurrency
    limits = httpx.Limits(max_connections=concurrency or 1024, max_keepalive_connections=concurrency or 1024)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        base, adapters = await _models(client)
        if names is not None:  # the bench's own server: adapter index k is the k-th name it built
            adapters = names
        if workload.spec.num_adapters and not adapters:
            raise SystemExit(f"the server at {url} serves no adapters; the workload needs them")
        bar = tqdm(total=len(workload.requests), desc="bench serve (http)", unit="req", disable=not progress)
        done: list[RequestTiming] = []
        start = time.perf_counter()

        async def serve(req: WorkloadRequest, arrival: float) -> None:
            model = base if req.adapter is None else adapters[req.adapter % len(adapters)]
            timing = RequestTiming(req.index, req.tenant, workload.popularity_class(req.adapter), arrival)
            await _one(client, req, model, timing, start, workload.spec.seed, vocab)
            done.append(timing)
            bar.update(1)

        if concurrency is not None:
            queue = list(workload.requests)

            async def worker() -> None:
                while queue:
                    req = queue.pop(0)
                    await serve(req, time.perf_counter() - start)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:

            async def at_arrival(req: WorkloadRequest) -> None:
                await asyncio.sleep(max(0.0, (req.arrival_s or 0.0) - (time.perf_counter() - start)))
                await serve(req, req.arrival_s or 0.0)

            await asyncio.gather(*(at_arrival(r) for r in workload.requests))
        bar.close()
        wall = time.perf_counter() - start
    summary = summarize(done, [], wall, max_num_seqs=concurrency or len(workload.requests))
    summary["server"] = {"url": url, "base": base, "adapters": len(adapters)}
    return summary


def run_http(
    url: str,
    workload: Workload,
    api_key: str | None,
    progress: bool,
    adapters: list[str] | None = None,
    vocab: int = _SAFE_VOCAB,
) -> dict[str, Any]:
    """`adapters`: the name of each workload adapter index (None: the server's listing, wrapping
    round); `vocab`: prompts' token ids are drawn below it (the default fits every vocabulary)."""
    return asyncio.run(_run(url.rstrip("/"), workload, api_key, progress, adapters, vocab))
