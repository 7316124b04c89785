"""Triton kernels, one op per module: the kernels, then their launcher; ops/ dispatches to them.
configs/<op>.py holds each op's launch config type and default-config table."""
