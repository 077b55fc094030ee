"""kvtier's vLLM connector. vLLM is imported only by the modules that need it.

Enable it with ``--kv-transfer-config '{"kv_connector": "KVTierConnector", "kv_role": "kv_both"}'``
(registered through vLLM's plugin entry point) or with
``"kv_connector_module_path": "kvtier.vllm.connector"``. See ``docs/vllm.md``.
"""
