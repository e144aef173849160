"""The learning oracle: a tiny real policy trained through the whole path by slime's own loops
and loss (`run.run_learning`), with the CPU actor that stands in for Megatron (`cpu_actor`) and
slime's `train.py` / `train_async.py` executed with Ray stood in for (`slime_loop`), slime loaded
and a user's loss flags read outside the tests (`slime_flags`). Used by `rollout bench --sections
learn` and the learning tests; `rollout check-signal`'s learning stage is its short form."""
