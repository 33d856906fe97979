"""Engine integrations, installed as ``semblend_sglang.patches``.

``sglang`` holds the SGLang radix-cache integration; ``vllm`` the KVConnectorBase_V1 connector.
Version-specific engine code lives only below this package.
"""
