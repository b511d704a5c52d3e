"""Reusable test helpers: real servers on free loopback ports (redis-server, uvicorn), no fakes."""
