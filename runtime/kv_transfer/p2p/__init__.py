"""The P2pTcpConnector: disaggregated prefill over TCP, as vLLM's P2pNcclConnector over NCCL:
each rank of a prefill instance keeps a finished prompt's KV in host memory and serves it on a
socket; the same rank of the decode instance fetches it."""
