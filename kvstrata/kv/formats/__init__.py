"""KV storage formats for the paged cache (`--kv-format`)."""
