"""Triton kernels, one op per module. Launchers live beside their kernels; ops/ dispatches to them."""
