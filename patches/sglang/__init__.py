"""SGLang integration (radix-cache patch, HiCache, plugin). Importing this package imports no
sglang module; sglang is touched only when a patch is applied."""
