"""Scale-out: tensor- and pipeline-parallel ranks on torch.distributed, data-parallel replicas behind a router."""
