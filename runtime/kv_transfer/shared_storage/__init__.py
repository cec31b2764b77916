"""The SharedStorageConnector (vLLM's name): disaggregated prefill through a folder that a
producer instance and a consumer instance both reach (one host, or a shared file system)."""
