"""Compiled kernels, built with torch's C++ extension mechanism (the README's set-up builds them; at run time
a missing compiler means the torch path runs instead, with a warning)."""
