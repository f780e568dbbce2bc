"""A bounded load test of ``deepinfer serve`` (CPU or GPU): a fixed number of streamed completions, a fixed number in
flight at once, all on localhost, within a time limit.

    python benchmarks/serve_load.py                        # starts `deepinfer serve` (the embedded model) itself
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --requests 256 --concurrency 32 --max-tokens 64
    python benchmarks/serve_load.py --model /path/to/ckpt --json load.json

It reports throughput (requests/s, generated tokens/s), time to first token (p50, p99) and end-to-end latency per
request, and whether every request finished; the exit status is 1 if any request failed or did not finish within
``--time-limit`` seconds. Only localhost URLs are accepted. Prompts are distinct lines of Python, so no two requests
are the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from urllib.parse import urlparse

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation between closest ranks; nan for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    at = q * (len(v) - 1)
    lo = int(at)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (at - lo)


async def _load(url: str, model: str, num_requests: int, concurrency: int, max_tokens: int, time_limit: float) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=time_limit)
    gate = asyncio.Semaphore(concurrency)
    records: list[dict] = []

    async def one(i: int) -> None:
        async with gate:
            start = time.perf_counter()
            rec = {"ttft_s": None, "tokens": 0, "finish_reason": None, "error": None}
            try:
                stream = await client.completions.create(
                    model=model,
                    prompt=f"def function_{i}(x):\n    # request {i}\n",
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                async for chunk in stream:
                    if chunk.choices:
                        if rec["ttft_s"] is None and chunk.choices[0].text:
                            rec["ttft_s"] = time.perf_counter() - start
                        if chunk.choices[0].finish_reason is not None:
                            rec["finish_reason"] = chunk.choices[0].finish_reason
                    if chunk.usage is not None:
                        rec["tokens"] = chunk.usage.completion_tokens
            except Exception as e:  # counted as a failed request
                rec["error"] = f"{type(e).__name__}: {e}"
            rec["latency_s"] = time.perf_counter() - start
            records.append(rec)

    start = time.perf_counter()
    tasks = [asyncio.create_task(one(i)) for i in range(num_requests)]
    _, pending = await asyncio.wait(tasks, timeout=time_limit)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    elapsed = time.perf_counter() - start
    await client.close()
    finished = [r for r in records if r["error"] is None and r["finish_reason"] is not None]
    ttft = [r["ttft_s"] for r in finished if r["ttft_s"] is not None]
    latency = [r["latency_s"] for r in finished]
    tokens = sum(r["tokens"] for r in finished)
    return {
        "requests": num_requests,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "finished": len(finished),
        "failed": sum(r["error"] is not None for r in records),
        "timed_out": len(pending),
        "errors": sorted({r["error"] for r in records if r["error"]})[:5],
        "seconds": elapsed,
        "requests_per_s": len(finished) / elapsed,
        "completion_tokens": tokens,
        "generated_tokens_per_s": tokens / elapsed,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "latency_p50_s": percentile(latency, 0.5),
        "latency_p99_s": percentile(latency, 0.99),
    }


def run_load(
    url: str, model: str, num_requests: int = 64, concurrency: int = 8, max_tokens: int = 32, time_limit: float = 300
) -> dict:
    """Runs the load against a server at ``url`` (localhost only) and returns the report (see the module)."""
    host = urlparse(url).hostname
    if host not in LOCAL_HOSTS:
        raise SystemExit(f"--url must be a localhost URL, got {url!r}")
    return asyncio.run(_load(url, model, num_requests, concurrency, max_tokens, time_limit))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(model: str | None, port: int, timeout: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "deepinfer", "serve", "--port", str(port), "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, env=os.environ.copy())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.25)
    proc.terminate()
    raise SystemExit(f"the server did not answer /health within {timeout} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (localhost); default: start `deepinfer serve` on a free port")
    p.add_argument("--model", help="checkpoint for the server started here (default: the embedded model)")
    p.add_argument("--served-model-name", help="the model name to request (default: the server's only model)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds for the whole load (default 300)")
    p.add_argument("--json", help="also write the report to this file")
    args = p.parse_args()
    proc = None
    url = args.url
    if url is None:
        port = _free_port()
        proc = _start_server(args.model, port, timeout=300)
        url = f"http://127.0.0.1:{port}"
    try:
        name = args.served_model_name
        if name is None:
            with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
                name = json.load(r)["data"][0]["id"]
        report = run_load(url, name, args.requests, args.concurrency, args.max_tokens, args.time_limit)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    ok = report["finished"] == report["requests"]
    print("every request finished" if ok else f"{report['requests'] - report['finished']} request(s) did not finish")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
