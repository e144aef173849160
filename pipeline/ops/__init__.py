"""The operator's views: one snapshot of a running pipeline (`monitor`), its Prometheus and wandb
export (`metrics`) and terminal view (`monitor_view`); the ledger of trained groups (`ledger`)
and `rollout show` (`show`)."""
