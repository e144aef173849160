"""Generate the simulated engine's step-time tables (workers/sim/step_tables/*.json) from
aiconfigurator-core (NVIDIA, Apache-2.0; `pip install -e .[test]` installs it): per model, GPU
and tensor-parallel size, the decode step latency by batch size and context
(`decode_step_latency`), the prefill latency by new tokens and cached prefix
(`predict_prefill_latency`) and the memory budget (`estimate_kv_cache`), all with its SGLang
database. The simulator reads only the committed tables (workers/sim/physics.py), so running
it needs no aiconfigurator; tests/test_sim_physics.py checks the tables against it.

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

    engine = EngineHandle.compile(model, gpu, AIC_BACKEND, tp_size=tp)
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
        "decode_batches": DECODE_BATCHES, "decode_contexts": DECODE_CONTEXTS,
        "decode_ms": [[round(engine.decode_step_latency(bs, ctx, 2), 4) for ctx in DECODE_CONTEXTS]
                      for bs in DECODE_BATCHES],
        "prefill_tokens": PREFILL_TOKENS, "prefill_prefixes": PREFILL_PREFIXES,
        "prefill_ms": [[round(engine.predict_prefill_latency(1, n + p, p), 4) for p in PREFILL_PREFIXES]
                       for n in PREFILL_TOKENS],
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
