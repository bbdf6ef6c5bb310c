"""`python -m kvstrata.kv.kernels.build`: build the compiled kernels now (the README's set-up runs it), and fail
loudly if they cannot be built."""

from kvstrata.kv.kernels import paged_decode

if paged_decode.kernel() is None:
    raise SystemExit("kvstrata: building the compiled KV kernels failed (see the warning above)")
print("kvstrata: compiled KV kernels built")
