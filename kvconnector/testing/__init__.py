"""Reliability harnesses shared by the tests and the command line: a fault-injecting
ZeroMQ proxy (``faultproxy``), a frame and dump fuzzer (``fuzz``), a long-running soak
(``soak``) and a two-namespace loopback pair (``netns``)."""
