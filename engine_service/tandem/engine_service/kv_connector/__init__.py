"""KV connector: moves a prompt's KV blocks from a producer engine to a consumer engine.

Disaggregated prefill/decode runs a request in two legs: a producer engine prefills
the prompt and keeps its blocks under a lease; a consumer engine pulls the blocks it does not
already hold in its own prefix cache, then decodes. The connector has the two sides vLLM's
connector interface has, meeting in the step plan:

- `scheduler_side.KVConnectorScheduler` (the engine-core thread, torch-free): how many tokens a
  request can load, allocating their blocks and holding the request in a waiting-for-KV state,
  leases on the producer (grant, release, expiry), the producer's returned parameters.
- `worker_side.KVConnectorWorker` (the worker, torch): registers the KV memory
  (`block_io.KVBlockIO`; for hybrid models also the state slots, `state_io.StateSlotIO`), starts
  the loads a plan's `kv_connector_metadata` names, writes the pulled bytes into every paged cache
  group's layer tensors (and the pulled state into the request's slot) and reports finished/failed
  loads.

Transports: `tcp_transport` (a msgpack-framed byte stream with a CRC32 per block; across hosts
and on CPU; the default) and `cuda_ipc` (the producer's cache tensors opened in the consumer's
process on the same host; the TCP connection carries only the handshake and the lease release).
Wire messages are `wire.py`'s msgspec structs, never pickle.
"""
