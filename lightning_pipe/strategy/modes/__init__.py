"""The modes a `PipeStrategy` runs in (local, rpc, launched): a file per mode, its checkpoints and optimizers beside."""
