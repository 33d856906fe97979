"""vLLM integration (KVConnectorBase_V1 connector). Importing this package imports no vllm
module."""
