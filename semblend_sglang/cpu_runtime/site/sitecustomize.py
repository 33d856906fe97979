"""semblend-sglang CPU runtime, loaded by every Python process whose PYTHONPATH holds this folder.

The launcher puts this folder on PYTHONPATH only on a machine without CUDA, so SGLang's spawned
scheduler and detokenizer processes get the same fix as the launching process: the torchvision
operator schemas are defined before torchvision is imported, and SGLang's KV canary gets its CPU
stand-ins before it is built (canary_shim.py). The folder also holds the import-only
``sgl_kernel`` stand-in. See docs/cpu.md.
"""

try:
    from semblend_sglang.cpu_runtime.canary_shim import install_canary_cpu_hook
    from semblend_sglang.cpu_runtime.torchvision_shim import install_torchvision_hook
except ImportError:  # semblend_sglang not importable in this interpreter: leave it untouched
    pass
else:
    install_torchvision_hook()
    install_canary_cpu_hook()
