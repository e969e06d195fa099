"""Serving: the continuous-batching scheduler, the OpenAI-compatible server, load tests and Ray Serve replicas."""
