"""Moving weights into rollout engines: sharded safetensors, the transports (shared memory, CUDA
IPC, broadcast, files) with their copy plans, the slice-to-slice pieces, and the receiving side
in the engine workers."""
