"""Moving expert tensors between attention replicas and expert servers: wire codec and transports."""
