"""Oaken (ISCA'25): offline thresholds, magnitude groups and the fused dense-sparse 4/5-bit KV format."""
