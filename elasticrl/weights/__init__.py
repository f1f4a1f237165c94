"""Moving weights into rollout engines: sharded safetensors, the transports (shared memory, broadcast,
files) with their copy plans, and the receiving side in the engine workers."""
