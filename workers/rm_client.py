"""slime's reward through `rollout rm-server`, where a failed measurement is a removed sample
instead of the end of the slime run (docs/environments.md, "slime's --rm-url").

    --custom-rm-path workers.rm_client.reward
    --rm-url http://rm-host:8000/<token>/<env>

slime's own `remote_rm` (`--rm-type remote_rm`, slime/rollout/rm_hub) retries every error
status alike, ten times over about 2.5 minutes, and then raises; slime's `generate_and_rm`
does not catch it, so one failed measurement (the rm-server's 422) or an outage longer than
that ends the run. This function is slime's custom reward contract (`async_rm` /
`batched_async_rm` call it with one sample or a list): it posts the same body as `remote_rm`
(`{prompt, response, label}`) to the same `--rm-url` and reads the answer by its status:

- 200: the reward (an answer the verifier gave up on is a 0 here, with the environment's
  default `on_undecided: zero`);
- 422, a failed measurement (a checker process that died, `on_undecided: remove`), and a
  400 whose body says `task_error` (a label the verifier cannot read as a gold): the sample is
  removed as the pipeline hands over a failed episode: `status` FAILED, `remove_sample` True,
  reward 0, the server's reason in `metadata["error"]`;
- 503 (an outage, or the server busy: its `Retry-After` is honoured), 408, a dropped
  connection or a timeout: tried again with backoff, `MAX_TRIES` in all, then removed the same
  way: an outage is no 0 to train and no reason to end the run;
- any other 4xx (a wrong URL or token, a body the server cannot read) and 500 (a bug):
  raised with the server's error text, so the run stops at the first, loudly.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any, Union

import aiohttp

log = logging.getLogger(__name__)

MAX_TRIES = 10  # as slime's remote_rm
BACKOFF_CAP_S = 30.0
REQUEST_TIMEOUT_S = 120.0  # as slime's shared session
RETRIED = (408, 503)

_session: Union[tuple[asyncio.AbstractEventLoop, aiohttp.ClientSession], None] = None


class RewardServerError(RuntimeError):
    """The rm-server refused the request for a reason no retry changes (a wrong URL or token, a
    body it cannot read) or hit a bug: the slime run should stop here."""


def _client() -> aiohttp.ClientSession:
    """One session per event loop (slime's rollout runs on one loop; a test on another)."""
    global _session
    loop = asyncio.get_running_loop()
    if _session is None or _session[0] is not loop or _session[1].closed:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        _session = (loop, aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64), timeout=timeout))
    return _session[1]


async def close() -> None:
    """Close this loop's session (tests; slime's process ends with it)."""
    global _session
    if _session is not None and _session[0] is asyncio.get_running_loop():
        await _session[1].close()
        _session = None


async def reward(args: Any, sample: Any, **_kwargs: Any) -> Any:
    """slime's custom reward function: a float per sample, a list for a list (module doc)."""
    if isinstance(sample, list):
        return list(await asyncio.gather(*(_reward_one(args, s) for s in sample)))
    return await _reward_one(args, sample)


async def _reward_one(args: Any, sample: Any) -> float:
    url = getattr(args, "rm_url", None)
    if not url:
        raise RewardServerError("workers.rm_client.reward needs --rm-url http://host:port/<token>/<env>")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    last = ""
    for attempt in range(MAX_TRIES):
        pause = min(2.0**attempt, BACKOFF_CAP_S) + random.random()
        try:
            async with _client().post(url, json=payload) as resp:
                status = resp.status
                body = await _json(resp)
                if status == 200 and isinstance(body, (int, float)) and not isinstance(body, bool):
                    return float(body)
                error = str(body.get("error", "")) if isinstance(body, dict) else str(body)[:300]
                if status == 422 or (status == 400 and isinstance(body, dict) and body.get("task_error")):
                    return _removed(sample, f"rm-server {status}: {error}")
                if status not in RETRIED:
                    raise RewardServerError(f"rm-server answered {status} (not retried): {error or body!r}"[:600])
                last = f"{status}: {error}"
                pause = max(pause, _retry_after(resp))
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if attempt + 1 < MAX_TRIES:
            await asyncio.sleep(pause)
    return _removed(sample, f"rm-server unavailable after {MAX_TRIES} tries; last: {last}"[:600])


async def _json(resp: aiohttp.ClientResponse) -> Any:
    try:
        return await resp.json(content_type=None)
    except ValueError:
        return (await resp.text())[:300]


def _retry_after(resp: aiohttp.ClientResponse) -> float:
    try:
        return float(resp.headers.get("Retry-After", 0.0))
    except ValueError:
        return 0.0


def _removed(sample: Any, why: str) -> float:
    """The sample as a failed measurement: no loss, never a 0 to train (as the pipeline's data
    source hands over a failed episode, and workers.inslime.reward marks one)."""
    log.warning("workers.rm_client: sample %s removed: %s", getattr(sample, "index", None), why)
    meta = sample.metadata if isinstance(getattr(sample, "metadata", None), dict) else {}
    sample.metadata = {**meta, "error": why[:2000]}
    sample.status = type(sample).Status.FAILED
    sample.remove_sample = True
    return 0.0
