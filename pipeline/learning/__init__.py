"""Checks of the learning signal: does what the trainer is handed line up token by token with the
policy that generated it (`signal_check`), and how far the policy moved between generating a
token and training on it (`drift`)."""
