"""The KV store below the paged cache: tiers (host memory, local disk, Redis) holding chunks of prefix KV
by their chained token hash, one object per (chunk, layer, K or V), each checked when read.

The engine asks it for the chunks of a prompt that the device pool lacks and writes the chunks it
computed down to it, both in the background (engine/kv_store_link.py).
"""
