"""`rollout show`: one episode as a readable conversation in the terminal.

    rollout show --dir LEDGER [--step R] [--group ID | --position P] [--sample J | --all] [--tokenizer T]
    rollout show --dir LEDGER --eval [--step R] ...   (a background evaluation round's group)
    rollout show --dead [STREAM_ID] [--redis-url URL] [--namespace NS] [--sample J | --all]

A trained episode comes from the ledger (pipeline/ops/ledger.py); a failed one from the dead-letter
stream `{ns}:dead` (a group of the wrong size or that does not decode, a job out of tries, a
requeue past its limit). Shown: the header (group, task, step, epoch/attempt, policy versions
and the engine's labels, staleness, worker, timings), the conversation (prompt, assistant
turns with their tool calls, tool outputs and other observations), the loss mask as colour
(green = trained, mask 1; yellow/dim = not trained, mask 0), and the reward with its components.

The conversation is the one the worker recorded (`metadata.messages`). Without it (groups
from older workers or built elsewhere) the prompt and the decoded response are shown. With
`--tokenizer` the response tokens themselves are decoded run by run and coloured by the mask.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from pipeline.schema import PromptJob, SampleGroup, SchemaError, Status, decode_group, decode_job, decode_requeue

TRAINED = "green"
NOT_TRAINED = "yellow"
PROMPT = "cyan"
ROLE_STYLE = {"system": "magenta", "user": PROMPT, "assistant": TRAINED, "tool": NOT_TRAINED}


class ShowError(RuntimeError):
    pass


# -------------------------------------------------------------------- pieces

def _kv_table(rows: list[tuple[str, Any]], title: str | None = None) -> Table:
    table = Table(show_header=False, box=None, title=title, title_justify="left", pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in rows:
        if value is None or value == "" or value == [] or value == {}:
            continue
        table.add_row(key, value if isinstance(value, Text) else _fmt(value))
    return table


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, list):  # content parts
        return "\n".join(str(p.get("text", p)) if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """[(value, run length)] of a loss mask."""
    runs: list[tuple[int, int]] = []
    for m in mask:
        if runs and runs[-1][0] == m:
            runs[-1] = (m, runs[-1][1] + 1)
        else:
            runs.append((int(m), 1))
    return runs


def mask_bar(mask: list[int], width: int = 80) -> Text:
    """The loss mask as a coloured bar (each cell a slice of the response) and its runs."""
    text = Text()
    n = len(mask)
    if n == 0:
        return Text("(no response tokens)", style="dim")
    cells = min(width, n)
    for c in range(cells):
        lo, hi = c * n // cells, max(c * n // cells + 1, (c + 1) * n // cells)
        part = mask[lo:hi]
        trained = sum(part) * 2 >= len(part)
        text.append("█" if trained else "░", style=TRAINED if trained else NOT_TRAINED)
    runs = mask_runs(mask)
    shown = " ".join(f"{v}×{k}" for v, k in runs[:24]) + (" …" if len(runs) > 24 else "")
    text.append(f"\n{sum(mask)}/{n} response tokens trained; runs {shown}", style="dim")
    return text


def token_text(tokens: list[int], response_length: int, mask: list[int], tokenizer: Any) -> Text:
    """The response decoded run by run, each run coloured by its mask value."""
    response = tokens[len(tokens) - response_length:]
    text = Text()
    start = 0
    for value, length in mask_runs(mask):
        piece = tokenizer.decode(response[start:start + length], skip_special_tokens=False)
        text.append(piece, style=TRAINED if value else f"{NOT_TRAINED} dim")
        start += length
    return text


def _tool_calls(message: dict[str, Any]) -> Text:
    text = Text()
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        text.append(f"\n→ {fn.get('name', '?')}({args})", style="bold " + TRAINED)
        if call.get("id"):
            text.append(f"  [{call['id']}]", style="dim")
    return text


def conversation(messages: list[dict[str, Any]], turn_log: list[dict[str, Any]]) -> list[RenderableType]:
    """Panels, one a message: the prompt (before the first assistant turn), then assistant
    turns (trained) and observations (not trained)."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    out: list[RenderableType] = []
    for m in messages[:first]:
        role = str(m.get("role", "?"))
        out.append(Panel(Text(_content(m)), title=f"{role} · prompt · not trained", title_align="left",
                         border_style=ROLE_STYLE.get(role, PROMPT)))
    turn = 0
    for m in messages[first:]:
        role = str(m.get("role", "?"))
        if role == "assistant":
            meta = turn_log[turn] if turn < len(turn_log) else {}
            body = Text(_content(m), style=TRAINED)
            body.append_text(_tool_calls(m))
            info = [f"turn {turn + 1}", "trained (mask 1)"]
            if meta:
                info.append(f"{meta.get('tokens', '?')} tokens, finish {meta.get('finish', '?')}")
                if meta.get("aborts"):
                    info.append(f"{meta['aborts']} abort(s)")
                if meta.get("weight_versions"):
                    info.append(f"engine {','.join(map(str, meta['weight_versions']))}")
                if meta.get("malformed"):
                    info.append(f"{meta['malformed']} malformed call(s)")
            out.append(Panel(body, title="assistant · " + " · ".join(info), title_align="left", border_style=TRAINED))
            turn += 1
        else:
            name = m.get("name")
            title = f"{role}{' ' + str(name) if name else ''} · observation · not trained (mask 0)"
            out.append(Panel(Text(_content(m), style=NOT_TRAINED), title=title, title_align="left",
                             border_style=ROLE_STYLE.get(role, NOT_TRAINED)))
    return out


def render_sample(group: SampleGroup, j: int, *, context: Sequence[tuple[str, Any]] = (), tokenizer: Any = None) -> Group:
    """One episode of `group`: header, conversation, mask, reward."""
    s = group.samples[j]
    meta = s.metadata
    status_style = {"completed": TRAINED, "failed": "red", "truncated": NOT_TRAINED, "aborted": NOT_TRAINED}
    header = _kv_table([
        *context,
        ("group", group.group_id),
        ("sample", f"{j + 1} of {group.n_samples}"),
        ("task", group.task_id),
        ("env", group.env),
        ("epoch / attempt", f"{group.epoch} / {group.attempt}"),
        ("admission version", group.admission_version),
        ("policy versions", f"{list(s.policy_versions)} (run {s.policy_run})" if s.policy_versions else None),
        ("engine labels", list(s.weight_versions)),
        ("worker", group.worker_id),
        ("group timings", group.timings),
        ("episode", {k: meta[k] for k in ("episode_s", "turns", "tool_calls", "malformed_tool_calls") if k in meta}),
        ("status", Text(s.status.value + ("  (not trained: loss removed)" if s.status is Status.FAILED else ""),
                        style=status_style.get(s.status.value, ""))),
        ("error", meta.get("error")),
        ("label", s.label),
    ], title=f"episode {group.group_id} #{j}")
    parts: list[RenderableType] = [header]
    messages = meta.get("messages")
    if isinstance(messages, list) and messages:
        parts += conversation(messages, list(meta.get("turn_log") or []))
    else:
        prompt = s.prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        parts += conversation(messages + [{"role": "assistant", "content": s.response.strip()}],
                              list(meta.get("turn_log") or []))
        if meta.get("messages") != "prompt+response":  # the worker's marker of a plain single-turn episode
            parts.append(Text("(the worker did not record the conversation: prompt and decoded response shown)",
                              style="dim"))
    mask = list(s.loss_mask_array().tolist())
    if tokenizer is not None:
        parts.append(Panel(token_text(s.token_array().tolist(), s.response_length, mask, tokenizer),
                           title="response tokens by loss mask (green trained, yellow not)", title_align="left"))
    parts.append(Panel(mask_bar(mask), title="loss mask", title_align="left"))
    reward = Text(f"{s.reward:.6g}", style="bold")
    rows: list[tuple[str, Any]] = [("reward", reward)]
    rows += [(f"  {k}", v) for k, v in sorted(s.reward_components.items())]
    if meta.get("step_rewards"):
        rows.append(("step rewards", meta["step_rewards"]))
    if "finished" in meta:
        rows.append(("env finished", str(meta["finished"])))
    parts.append(Panel(_kv_table(rows), title="reward", title_align="left"))
    return Group(*parts)


def render_group(group: SampleGroup, samples: list[int], *, context: Sequence[tuple[str, Any]] = (),
                 tokenizer: Any = None) -> Group:
    return Group(*[render_sample(group, j, context=context, tokenizer=tokenizer) for j in samples])


def render_dead(stream_id: str, fields: dict[str, Any], *, sample: int | None = 0, all_samples: bool = False,
                tokenizer: Any = None) -> Group:
    """One `{ns}:dead` entry: why it is there, and its payload decoded by its source."""
    def s(key: str) -> str:
        v = fields.get(key, b"")
        return v.decode(errors="replace") if isinstance(v, bytes) else str(v)

    payload = fields.get("payload", b"")
    payload = payload if isinstance(payload, bytes) else str(payload).encode()
    source = s("source")
    head = [("dead letter", stream_id), ("source", source), ("ref", s("ref")), ("at", s("at")),
            ("reason", Text(s("reason"), style="red")), ("payload", f"{len(payload):,} bytes")]
    parts: list[RenderableType] = []
    try:
        if source == "groups":
            group = decode_group(payload)
            parts.append(_kv_table(head))
            picks = list(range(group.n_samples)) if all_samples else [min(sample or 0, group.n_samples - 1)]
            parts.append(render_group(group, picks, context=[("from", f"dead letter {stream_id}")], tokenizer=tokenizer))
            return Group(*parts)
        if source == "jobs":
            job = decode_job(payload)
            parts.append(_kv_table(head + _job_rows(job)))
            parts.append(Text("(a job dead-lettered before its group was pushed: no episode was kept)", style="dim"))
            return Group(*parts)
        if source == "requeue":
            back = decode_requeue(payload)
            parts.append(_kv_table(head + [("task", back.task.id), ("env", back.task.env),
                                           ("epoch / attempt", f"{back.epoch} / {back.attempt}"),
                                           ("handed back as", back.reason.value), ("prompt", _prompt_text(back.task.prompt))]))
            return Group(*parts)
    except SchemaError as exc:
        head.append(("decode", Text(str(exc), style="red")))
    head.append(("payload head", payload[:200].hex(" ") if payload else ""))
    return Group(_kv_table(head))


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', '?')}: {_content(m)}" for m in prompt)


def _job_rows(job: PromptJob) -> list[tuple[str, Any]]:
    return [("job", job.job_id), ("task", job.task.id), ("env", job.task.env),
            ("epoch / attempt", f"{job.epoch} / {job.attempt}"), ("samples", job.n_samples),
            ("admission version", job.admission_version), ("label", job.task.label),
            ("prompt", _prompt_text(job.task.prompt))]


# ----------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout show", description="Render a trained episode (from the ledger) "
                                "or a dead letter as a readable conversation.")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--dir", help="ledger directory (pipeline_ledger_dir)")
    where.add_argument("--dead", nargs="?", const="last", metavar="STREAM_ID",
                       help="a `{ns}:dead` entry (default: the newest)")
    p.add_argument("--eval", action="store_true",
                   help="an evaluation round's group (<dir>/eval; --step: the rollout of slime's eval call)")
    p.add_argument("--step", type=int, default=None, help="ledger step (default: the last, or the newest with --group)")
    p.add_argument("--group", default=None, help="group id (e.g. task-7:0)")
    p.add_argument("--position", type=int, default=0, help="the group's place in the step (default 0)")
    p.add_argument("--sample", type=int, default=0, help="episode index in the group (default 0)")
    p.add_argument("--all", action="store_true", help="every episode of the group")
    p.add_argument("--tokenizer", default=None, help="decode the response tokens with this tokenizer, coloured by mask")
    p.add_argument("--redis-url", default=None, help="default: $ROLLOUT_REDIS_URL or redis://127.0.0.1:6379/0")
    p.add_argument("--namespace", default=os.environ.get("ROLLOUT_NAMESPACE", "rollout"))
    p.add_argument("--width", type=int, default=None, help="terminal width")
    return p


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = console or Console(width=args.width)
    try:
        console.print(_renderable(args))
    except ShowError as exc:
        print(f"rollout show: {exc}", file=sys.stderr)
        return 2
    return 0


def _tokenizer(name: str | None) -> Any:
    if not name:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # noqa: BLE001 - any load failure is the user's path/name
        raise ShowError(f"tokenizer {name!r}: {exc}") from None


def _renderable(args: argparse.Namespace) -> RenderableType:
    tokenizer = _tokenizer(args.tokenizer)
    if args.dead is not None:
        return _dead(args, tokenizer)
    from pipeline.ops.ledger import Ledger, LedgerError

    ledger = Ledger(os.path.join(args.dir, "eval") if args.eval else args.dir)
    if not ledger.dir.is_dir():
        raise ShowError(f"ledger {args.dir} is not a directory")
    try:
        if args.group:
            lg = ledger.find(args.group, args.step)
        else:
            steps = ledger.steps()
            if not steps:
                raise ShowError(f"ledger {args.dir}: no steps")
            rid = args.step if args.step is not None else steps[-1]
            groups = ledger.groups(rid)
            if not 0 <= args.position < len(groups):
                raise ShowError(f"ledger step {rid} has {len(groups)} groups; --position {args.position} is out of range")
            lg = groups[args.position]
    except LedgerError as exc:
        raise ShowError(str(exc)) from None
    group = lg.group
    if not args.all and not 0 <= args.sample < group.n_samples:
        raise ShowError(f"group {group.group_id} has {group.n_samples} samples; --sample {args.sample} is out of range")
    picks = list(range(group.n_samples)) if args.all else [args.sample]
    context = [("trained in step", lg.rollout_id), ("position", lg.position), ("stream id", lg.stream_id),
               ("oldest version", f"{lg.oldest_version} (staleness {lg.rollout_id - lg.oldest_version})")]
    if args.eval:
        context = [*_eval_context(ledger.dir, lg.rollout_id, group), ("position", lg.position),
                   ("stream id", lg.stream_id)]
    return render_group(group, picks, context=context, tokenizer=tokenizer)


def _eval_context(directory: Any, rollout_id: int, group: SampleGroup) -> list[tuple[str, Any]]:
    """An eval group's header: its round, and the one version it is reported under (or why none)."""
    from pipeline.eval.background import reported_version, step_of_version, version_tokens

    version, mixed = reported_version(group)
    if version is None:
        under = "none: every episode failed"
    else:
        under = f"{version} (logged at rollout step {step_of_version(version)})"
        if mixed:
            under += f"; mixed: tokens of versions {sorted(version_tokens(group))}, most of them of {version}"
    rows: list[tuple[str, Any]] = [("eval round at rollout", rollout_id), ("reported under version", under)]
    summary = os.path.join(str(directory), f"round-{rollout_id:08d}.json")
    if os.path.exists(summary):
        with open(summary) as fh:
            meta = json.load(fh)
        rows.append(("round", f"{meta['round_id']} {meta['state']}, versions {meta['versions']}, "
                              f"{meta['groups_mixed']} mixed, {meta['groups_failed']} failed"))
    return rows


def _dead(args: argparse.Namespace, tokenizer: Any) -> RenderableType:
    from redis.exceptions import RedisError

    from pipeline.keys import Keys
    from pipeline.store.redis_conn import DEFAULT_REDIS_URL, ENV_REDIS_URL, connect, redact

    url = args.redis_url or os.environ.get(ENV_REDIS_URL, DEFAULT_REDIS_URL)
    keys = Keys(args.namespace)

    async def fetch() -> list[Any]:
        client = connect(url)
        try:
            if args.dead == "last":
                return await client.xrevrange(keys.dead, count=1)
            return await client.xrange(keys.dead, min=args.dead, max=args.dead, count=1)
        finally:
            await client.aclose()

    try:
        rows = asyncio.run(fetch())
    except (OSError, RedisError) as exc:  # unreachable, refused, auth: the CLI's connection class (exit 3)
        raise ConnectionError(f"cannot read {keys.dead} at {redact(url)}: {type(exc).__name__}: {exc}") from None
    if not rows:
        raise ShowError(f"{keys.dead} at {redact(url)} has no entry {'' if args.dead == 'last' else args.dead}".rstrip())
    raw_id, raw_fields = rows[0]
    fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw_fields.items()}
    stream_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
    return render_dead(stream_id, fields, sample=args.sample, all_samples=args.all, tokenizer=tokenizer)
