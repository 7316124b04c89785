"""What tests/kernels/gpu_compile.py compiles for each GPU target: compile_specs/<op>.py lists the
specializations the launchers of kernels/<op>.py use (one module per kernel module)."""
