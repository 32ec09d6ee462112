"""Communication primitives the model uses: its shard of the layers, the process groups, the shared-memory
all-reduce."""
