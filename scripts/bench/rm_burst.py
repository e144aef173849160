"""A burst of slow answers against `rollout rm-server`: what its latency budget admits.

    python -m scripts.bench.rm_burst [--requests 64] [--bursts 2] [-- rm-server options ...]

Starts `rollout rm-server` (a `math` environment with its defaults: 2 checker processes,
`parse_timeout_s` 5) on loopback, posts `--requests` answers math-verify gives up on
(`\\boxed{10^{10^{10}}}`) at once, `--bursts` times one after the other (the first cold, the
next with the service time observed), and prints per burst the 200s (latency max, mean) and the
503s (latency max, Retry-After), then the server's counters from `/metrics` and its stats lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from pipeline.store.local_redis import free_port

SLOW = {"prompt": "What is 2 + 3?", "response": "\\boxed{10^{10^{10}}}", "label": "5"}


async def _post(http: aiohttp.ClientSession, url: str) -> tuple[int, float, str]:
    started = time.monotonic()
    async with http.post(url, json=SLOW) as resp:
        await resp.read()
        return resp.status, time.monotonic() - started, resp.headers.get("Retry-After", "")


async def _burst(http: aiohttp.ClientSession, url: str, requests: int) -> str:
    answers = await asyncio.gather(*(_post(http, url) for _ in range(requests)))
    scored = [s for status, s, _ in answers if status == 200]
    busy = [(s, retry) for status, s, retry in answers if status == 503]
    other = sorted(status for status, _, _ in answers if status not in (200, 503))
    return (f"{requests} at once: {len(scored)} answered 200 (max {max(scored, default=0):.1f}s, mean "
            f"{sum(scored) / max(len(scored), 1):.1f}s); {len(busy)} answered 503 (max "
            f"{max((s for s, _ in busy), default=0) * 1000:.0f} ms, Retry-After {sorted({r for _, r in busy})}); "
            f"other statuses: {other or 'none'}")


async def _run(port: int, requests: int, bursts: int) -> None:
    base = f"http://127.0.0.1:{port}"
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        for _ in range(bursts):
            print(await _burst(http, f"{base}/math", requests), flush=True)
        async with http.get(f"{base}/metrics") as resp:
            text = await resp.text()
    print("\n".join(line for line in text.splitlines()
                    if line.startswith("rollout_rm_") and "_bucket" not in line and "_created" not in line))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--bursts", type=int, default=2)
    p.add_argument("server_args", nargs="*", help="more rollout rm-server options (after --)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "pipeline.json"
        config.write_text(json.dumps({"environments": {"math": {"kind": "math"}}}))
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "scripts.cli", "rm-server", "--config", str(config), "--port",
                                   str(port), "--stats-interval-s", "10", *args.server_args],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert server.stdout is not None
            print(server.stdout.readline().strip(), flush=True)
            asyncio.run(_run(port, args.requests, args.bursts))
        finally:
            server.terminate()
            out, _ = server.communicate(timeout=30)
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
