"""Files whose every test runs upstream code (slime, SGLang, NeMo-RL, NeMo-Skills, NeMo Gym,
aiconfigurator) on the pipeline's outputs: `-m conformance`, skipped without the extra."""
