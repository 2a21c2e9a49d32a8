"""Wire plumbing shared by the three services: the internal messages codec, gRPC statuses, the server set-up."""
