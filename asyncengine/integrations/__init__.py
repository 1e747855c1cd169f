"""Helpers for embedding AsyncLLM in web frameworks: `asyncengine.integrations.aiohttp`
(cleanup context, SSE streaming) and `asyncengine.integrations.starlette` (SSE streaming).
"""
