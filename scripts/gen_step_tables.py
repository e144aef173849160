"""Generate the simulated engine's step-time tables (workers/sim/step_tables/*.json) from
aiconfigurator-core (NVIDIA, Apache-2.0; `pip install -e .[test]` installs it): per model, GPU
and tensor-parallel size, the decode step latency by batch size and context
(`decode_step_latency`), a batched prefill's two parts as `mixed_step_breakdown` splits it (the
layers outside attention by the batch's new tokens; context attention per sequence by batch
size, new tokens and cached prefix) and the memory budget (`estimate_kv_cache`), all with its
SGLang database. The context and prefix axes end at the model's context length
(`max_position_embeddings` in aiconfigurator's model config). The simulator reads only the committed tables (workers/sim/physics.py), so running
it needs no aiconfigurator; tests/conformance/test_sim_physics.py checks the tables against it.

    python scripts/gen_step_tables.py                      # the committed set
    python scripts/gen_step_tables.py --model Qwen/Qwen3-8B --gpu h100_sxm --tp 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from workers.sim.physics import (  # noqa: E402
    AIC_BACKEND,
    AIC_DATABASE,
    DECODE_BATCHES,
    DECODE_CONTEXTS,
    PREFILL_BATCHES,
    PREFILL_PREFIXES,
    PREFILL_TOKENS,
    TABLE_DIR,
    table_path,
)

COMMITTED = [(m, g, 1) for m in ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-8B") for g in ("h100_sxm", "h200_sxm")]


def generate(model: str, gpu: str, tp: int) -> dict[str, Any]:
    """One table: every value straight from aiconfigurator-core's calls (milliseconds, bytes)."""
    import importlib.metadata

    from aiconfigurator_core.sdk.engine import EngineHandle
    from aiconfigurator_core.sdk.memory import estimate_kv_cache
    from aiconfigurator_core.sdk.utils import get_model_config_from_model_path

    engine = EngineHandle.compile(model, gpu, AIC_BACKEND, tp_size=tp)
    context = int(get_model_config_from_model_path(model)["context"])
    contexts = [c for c in DECODE_CONTEXTS if c < context] + [context]
    prefixes = [p for p in PREFILL_PREFIXES if p < context] + [context]

    def shared(tokens: int) -> float:  # every layer but attention: a function of the batch's tokens only
        return float(engine.mixed_step_breakdown(tokens, 0, tokens, 2, 0)[1])

    def attention(batch: int, tokens: int, prefix: int) -> float:
        """Context attention of `batch` sequences of `tokens` new tokens over `prefix` cached ones
        (mixed_step_breakdown's context tokens count each sequence's whole isl), per sequence."""
        return float(engine.mixed_step_breakdown(batch * (tokens + prefix), 0, tokens + prefix, 2, prefix)[2]) / batch

    memory = estimate_kv_cache(model, gpu, AIC_BACKEND, AIC_DATABASE, max_num_tokens=8192, max_batch_size=256,
                               memory_fraction_kind="of_total", memory_fraction_value=0.9, tp_size=tp)
    breakdown = memory["memory_breakdown"]
    return {
        "model": model, "gpu": gpu, "tp": tp, "backend": AIC_BACKEND, "database": AIC_DATABASE,
        "source": f"aiconfigurator-core {importlib.metadata.version('aiconfigurator-core')}",
        "gpu_memory_bytes": memory["total_gpu_capacity_bytes"],
        "weights_bytes": breakdown["weights_bytes"],
        "reserved_bytes": breakdown["activations_bytes"] + breakdown["runtime_overhead_bytes"]
        + breakdown["comm_overhead_bytes"],
        "kv_bytes_per_token": memory["kv_size_per_token_bytes"],
        "context_length": context,
        "decode_batches": DECODE_BATCHES, "decode_contexts": contexts,
        "decode_ms": [[round(engine.decode_step_latency(bs, ctx, 2), 4) for ctx in contexts]
                      for bs in DECODE_BATCHES],
        "prefill_tokens": PREFILL_TOKENS, "prefill_prefixes": prefixes, "prefill_batches": PREFILL_BATCHES,
        "prefill_shared_ms": [round(shared(n), 4) for n in PREFILL_TOKENS],
        "prefill_attn_ms": [[[round(attention(b, n, p), 4) for p in prefixes] for n in PREFILL_TOKENS]
                            for b in PREFILL_BATCHES],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF model id aiconfigurator knows (default: the committed set)")
    p.add_argument("--gpu", default="h100_sxm", help="aiconfigurator system name (default %(default)s)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default %(default)s)")
    args = p.parse_args(argv)
    todo = [(args.model, args.gpu, args.tp)] if args.model else COMMITTED
    TABLE_DIR.mkdir(exist_ok=True)
    for model, gpu, tp in todo:
        path = table_path(model, gpu, tp)
        path.write_text(json.dumps(generate(model, gpu, tp), separators=(",", ":")) + "\n")
        print(f"{path.relative_to(REPO)}: {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
