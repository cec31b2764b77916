"""KV connectors (the contract is `runtime.plugins.kv_connector`): the built-in ones, plugins'
ones, and building the side each process runs."""
