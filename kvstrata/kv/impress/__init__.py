"""IMPRESS (papers/impress.md): load only the important tokens of a stored prefix, chosen per layer from the
probe heads' attention (docs/DESIGN.md, "IMPRESS")."""
