"""gRPC plumbing shared by every service: generated stubs, server and channel builders."""
