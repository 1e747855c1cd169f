"""The client's end of the engine cores: EngineCoreClient and what it is made of.

client.py (the EngineCoreClient ABC AsyncLLM talks to), proc_client.py (N >= 1 cores over
ZMQ), thread_client.py (the core in a thread), handle.py (CoreHandle, CoreBackend),
process.py / ray_core.py / attached.py (a core as this process's child, a Ray actor's, or
another process's), handshake.py, launch.py (a core per rank), ranks.py / dp_ranks.py /
dp_router.py (what the client keeps per rank; data parallel only when there are several).
"""
