"""KV placement below the compute device (`--kv-offload`): the cache in a host pool, read back per layer in
full (FlexGen-style offload) or only the tokens InfiniGen's speculation picks (docs/DESIGN.md)."""
